"""The package layout: the former module paths still import, as the same modules; no import
cycle and no private name across subpackages."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

import sdc_guard

FORMER = {
    "sdc_guard.guard": "sdc_guard.runtime.lifecycle.guard",
    "sdc_guard.inject": "sdc_guard.runtime.drills.inject",
    "sdc_guard.sampling": "sdc_guard.runtime.sampling",
    "sdc_guard.policy": "sdc_guard.respond.policy",
    "sdc_guard.snapshot": "sdc_guard.respond.snapshot",
    "sdc_guard.legacy": "sdc_guard.core.legacy",
    "sdc_guard.toy_gpt": "sdc_guard.tools.toy_gpt",
    "sdc_guard.core.verify": "sdc_guard.verify",
    "sdc_guard.runtime.report": "sdc_guard.report",
    "sdc_guard.runtime.attention": "sdc_guard.runtime.dispatch.attention",
    "sdc_guard.runtime.budget": "sdc_guard.runtime.sampling.budget",
    "sdc_guard.runtime.cache": "sdc_guard.runtime.checking.cache",
    "sdc_guard.runtime.calibration": "sdc_guard.runtime.lifecycle.calibration",
    "sdc_guard.runtime.checker": "sdc_guard.runtime.checking.checker",
    "sdc_guard.runtime.checks": "sdc_guard.runtime.lifecycle.checks",
    "sdc_guard.runtime.collective_checks": "sdc_guard.runtime.collectives.collective_checks",
    "sdc_guard.runtime.collective_faults": "sdc_guard.runtime.collectives.collective_faults",
    "sdc_guard.runtime.collective_ops": "sdc_guard.runtime.dispatch.collective_ops",
    "sdc_guard.runtime.config": "sdc_guard.runtime.lifecycle.config",
    "sdc_guard.runtime.fault_models": "sdc_guard.runtime.drills.fault_models",
    "sdc_guard.runtime.function_attention": "sdc_guard.runtime.compiled.function_attention",
    "sdc_guard.runtime.function_gemm": "sdc_guard.runtime.compiled.function_gemm",
    "sdc_guard.runtime.function_mode": "sdc_guard.runtime.compiled.function_mode",
    "sdc_guard.runtime.gradient_stats": "sdc_guard.runtime.sampling.gradient_stats",
    "sdc_guard.runtime.graph_checks": "sdc_guard.runtime.compiled.graph_checks",
    "sdc_guard.runtime.graph_install": "sdc_guard.runtime.compiled.graph_install",
    "sdc_guard.runtime.graph_ops": "sdc_guard.runtime.compiled.graph_ops",
    "sdc_guard.runtime.graph_pass": "sdc_guard.runtime.compiled.graph_pass",
    "sdc_guard.runtime.guard": "sdc_guard.runtime.lifecycle.guard",
    "sdc_guard.runtime.guarded_step": "sdc_guard.runtime.lifecycle.guarded_step",
    "sdc_guard.runtime.hops": "sdc_guard.runtime.dispatch.hops",
    "sdc_guard.runtime.inject": "sdc_guard.runtime.drills.inject",
    "sdc_guard.runtime.intake": "sdc_guard.runtime.lifecycle.intake",
    "sdc_guard.runtime.intercept": "sdc_guard.runtime.dispatch.intercept",
    "sdc_guard.runtime.interception": "sdc_guard.runtime.lifecycle.interception",
    "sdc_guard.runtime.ledger": "sdc_guard.runtime.lifecycle.ledger",
    "sdc_guard.runtime.module_names": "sdc_guard.runtime.compiled.module_names",
    "sdc_guard.runtime.ops": "sdc_guard.runtime.dispatch.ops",
    "sdc_guard.runtime.optimizer_steps": "sdc_guard.runtime.lifecycle.optimizer_steps",
    "sdc_guard.runtime.sampler_base": "sdc_guard.runtime.sampling.sampler_base",
    "sdc_guard.runtime.schedule": "sdc_guard.runtime.sampling.schedule",
    "sdc_guard.runtime.screened": "sdc_guard.runtime.sampling.screened",
    "sdc_guard.runtime.site_hooks": "sdc_guard.runtime.dispatch.site_hooks",
    "sdc_guard.runtime.stats": "sdc_guard.runtime.lifecycle.stats",
    "sdc_guard.runtime.warn_once": "sdc_guard.runtime.lifecycle.warn_once",
}


@pytest.mark.parametrize("old", sorted(FORMER))
def test_former_module_path_is_the_same_module(old: str) -> None:
    assert importlib.import_module(old) is importlib.import_module(FORMER[old])
    parent, _, leaf = old.rpartition(".")
    assert getattr(importlib.import_module(parent), leaf) is importlib.import_module(FORMER[old])


def test_public_names() -> None:
    from sdc_guard.metrics import GuardMetrics  # noqa: F401
    from sdc_guard.policy import Policy
    from sdc_guard.sampling import Budget, Screened  # noqa: F401

    import sdc_guard.bi

    assert sdc_guard.Policy is Policy
    assert callable(sdc_guard.bi.check) and callable(sdc_guard.protect) and callable(sdc_guard.verify_matmul)
    assert sdc_guard.backends.get("torch").name == "torch"
    for name in ("get", "register", "unregister", "select", "status", "available", "reprobe", "registered",
                 "Backend", "GemmRequest", "TorchBackend", "TritonBackend", "CpuBackend", "ENV_BACKEND"):
        assert hasattr(sdc_guard.backends, name), name
    # SDCGuard is resolved on first use (it imports Lightning)
    assert set(sdc_guard.__all__) - {"SDCGuard"} <= set(dir(sdc_guard))


@pytest.mark.slow  # integration-heavy (a subprocess, a CLI run, a training loop): see CONTRIBUTING.md
def test_former_path_in_a_fresh_process() -> None:
    """``import sdc_guard.sampling`` as the first import of a process (the parent's
    ``__init__`` registers the former paths before the child is looked up)."""
    code = "import sdc_guard.toy_gpt, sdc_guard.sampling as s; print(s.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "sdc_guard.runtime.sampling"


# --- the import graph of the package's sources (sdc_guard/), read
# with ast: every import statement, at module level or inside a function; those under
# ``if TYPE_CHECKING:`` (annotations only: never executed) count between subpackages (a
# layer names no type of a layer above it either) and are left out between the modules
# of one subpackage (a module's type hints may name the class that owns it)

from paths import ROOT  # noqa: E402

SOURCES = {"sdc_guard": ROOT / "sdc_guard"}
#: the subpackages; a module directly under sdc_guard/ (metrics.py, ...) is its own unit
#: compiled modules (no source here): importing one imports no source module
EXTENSIONS = {"sdc_guard._vabft_cpu"}
UNITS = ("core", "backends", "runtime", "respond", "bi", "tools", "kernels", "integrations")
#: subpackages whose own folders are units too (runtime/: one folder per concern)
#: (in their import order: each imports only folders before it; runtime/__init__.py)
NESTED = {"runtime": ("sampling", "dispatch", "checking", "compiled", "collectives", "drills", "lifecycle")}


def source_modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's ``__init__``) for every source module."""
    mods: dict[str, tuple[Path, bool]] = {}
    for pkg, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            mods[".".join([pkg, *(parts[:-1] if is_pkg else parts)])] = (path, is_pkg)
    return mods


def _executed_imports(tree: ast.AST, type_checking: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements of ``tree``; those under ``if TYPE_CHECKING:`` only with
    ``type_checking``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) and not type_checking:
            for child in node.orelse:
                yield from _executed_imports(ast.Module(body=[child], type_ignores=[]))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _executed_imports(node, type_checking)


def imports_of(name: str, path: Path, is_pkg: bool, type_checking: bool = False) -> list[tuple[str, str | None, int]]:
    """(module imported, name taken from it or ``None``, line) for each import in ``path``
    (with ``type_checking``, those under ``if TYPE_CHECKING:`` too); ``from pkg import
    sub`` of a submodule counts as importing ``pkg.sub``."""
    out = []
    for node in _executed_imports(ast.parse(path.read_text(), str(path)), type_checking):
        if isinstance(node, ast.Import):
            out += [(alias.name, None, node.lineno) for alias in node.names]
            continue
        target = node.module or ""
        if node.level:
            base = name.split(".") if is_pkg else name.split(".")[:-1]
            base = base[: len(base) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        out += [(target, alias.name, node.lineno) for alias in node.names]
    return out


def unit(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 2 and parts[2] in NESTED.get(parts[1], ()):
        return ".".join(parts[:3])
    return ".".join(parts[:2]) if len(parts) > 1 and parts[1] in UNITS else module


def import_graph(type_checking: bool = False) -> dict[str, dict[str, int]]:
    """Module -> {source module it imports: first line} (``type_checking``: counting the
    imports under ``if TYPE_CHECKING:``)."""
    mods = source_modules()
    graph: dict[str, dict[str, int]] = {}
    for name, (path, is_pkg) in mods.items():
        edges = graph.setdefault(name, {})
        for target, taken, line in imports_of(name, path, is_pkg, type_checking):
            full = f"{target}.{taken}" if taken else target
            if full in EXTENSIONS:
                continue
            hit = full if full in mods else target if target in mods else None
            if hit is not None and hit != name:
                edges.setdefault(hit, line)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _describe(graph: dict[str, dict[str, int]], comp: list[str]) -> str:
    return "; ".join(f"{a}:{line} -> {b}" for a in comp for b, line in graph[a].items() if b in comp)


def test_cycle_finder_finds_a_function_level_cycle() -> None:
    """The checks below can fail: a cycle through an import inside a function is found."""
    assert cycles({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}) == [["a", "b", "c"]]
    code = "def f():\n    from .b import g\nif TYPE_CHECKING:\n    from .c import h\n"
    tree = ast.parse(code)
    assert [node.module for node in _executed_imports(tree)] == ["b"]
    assert [node.module for node in _executed_imports(tree, type_checking=True)] == ["b", "c"]


def test_no_import_cycle_between_modules() -> None:
    graph = import_graph()
    assert "sdc_guard.runtime.lifecycle.guard" in graph and "sdc_guard.kernels.vabft_triton" in graph
    found = cycles(graph)
    assert not found, "import cycles: " + " | ".join(_describe(graph, comp) for comp in found)


def test_no_import_cycle_between_subpackages() -> None:
    """The layers: core <- kernels <- backends <- respond <- runtime ... (no subpackage
    imports one that imports it back), counting every import, those under ``if
    TYPE_CHECKING:`` too: the response side names no type of the guard's. The package's
    ``__init__`` (the public facade, which imports every layer) is left out."""
    graph: dict[str, dict[str, int]] = {}
    for a, edges in import_graph(type_checking=True).items():
        for b, line in edges.items():
            if "sdc_guard" not in (a, b) and unit(a) != unit(b):
                graph.setdefault(unit(a), {}).setdefault(unit(b), line)
    found = cycles(graph)
    assert not found, "subpackage cycles: " + " | ".join(" <-> ".join(comp) for comp in found)


def subpackage_graph() -> dict[str, dict[str, int]]:
    """Unit -> {unit it imports: a line}, counting ``TYPE_CHECKING`` imports."""
    graph: dict[str, dict[str, int]] = {}
    for a, edges in import_graph(type_checking=True).items():
        for b, line in edges.items():
            if "sdc_guard" not in (a, b) and unit(a) != unit(b):
                graph.setdefault(unit(a), {}).setdefault(unit(b), line)
    return graph


def test_runtime_folders_import_only_the_folders_before_them() -> None:
    """Each folder of runtime/ is a unit of its own (the cycle check above sees them), and
    the order runtime/__init__.py documents holds: a folder imports only folders listed
    before it in ``NESTED["runtime"]`` (so nothing below imports the guard's lifecycle),
    counting ``TYPE_CHECKING`` imports."""
    assert unit("sdc_guard.runtime.lifecycle.guard") == "sdc_guard.runtime.lifecycle"
    assert unit("sdc_guard.runtime.sampling") == "sdc_guard.runtime.sampling"
    assert unit("sdc_guard.core.precision") == "sdc_guard.core"
    graph = subpackage_graph()
    order = [f"sdc_guard.runtime.{name}" for name in NESTED["runtime"]]
    assert set(order) <= set(graph), sorted(set(order) - set(graph))
    bad = [f"{a} imports {b} (line {line})" for i, a in enumerate(order)
           for b, line in graph[a].items() if b in order[i:]]
    assert not bad, "; ".join(bad)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_definitions(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, classes, assigned names and attributes."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return {name for name in names if _private(name)}


def private_uses(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """``obj._name`` read, and ``obj.__dict__["_name"]`` / ``.__dict__.get("_name")``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and _private(node.attr):
            yield node.attr, node.lineno
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _private(node.value) \
                and node.value.isidentifier():
            yield node.value, node.lineno


def test_no_private_name_crosses_a_subpackage() -> None:
    """What crosses a subpackage's boundary is public and documented: refused are
    ``from <other subpackage> import _name``, and reading ``x._name`` (or a ``__dict__`` key
    ``"_name"``) where only another subpackage defines ``_name``. The compiled extension
    ``sdc_guard._vabft_cpu`` is private to ``backends/native.py``, its one user."""
    mods = source_modules()
    trees = {name: ast.parse(path.read_text(), str(path)) for name, (path, _) in mods.items()}
    defined: dict[str, set[str]] = {}
    for name, tree in trees.items():
        defined.setdefault(unit(name), set()).update(private_definitions(tree))
    bad = []
    for name, (path, is_pkg) in mods.items():
        for target, taken, line in imports_of(name, path, is_pkg):
            full = f"{target}.{taken}" if taken else target
            if taken and _private(taken) and full not in EXTENSIONS and target.startswith("sdc_guard") \
                    and unit(target) != unit(name):
                bad.append(f"{name}:{line} imports {taken} from {target}")
        own = defined[unit(name)]
        for attr, line in private_uses(trees[name]):
            others = [u for u, names in defined.items() if u != unit(name) and attr in names]
            if attr not in own and others:
                bad.append(f"{name}:{line} uses {attr}, private to {others[0]}")
    assert not bad, "private names across subpackages: " + "; ".join(sorted(set(bad)))


def test_the_repository_root_holds_one_importable_package() -> None:
    """Code run from the root (``python -m pytest``, the examples) has the root on its path:
    a folder there with an ``__init__.py`` shadows any installed distribution of that
    name, and libraries probe optional packages by name (transformers 5.25 imports
    ``kernels``, the Hugging Face kernel hub, when ``find_spec("kernels")`` finds one: a
    top-level ``kernels/`` of ours broke every transformers import run from the root)."""
    packages = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert packages == ["sdc_guard"]
    plain = sorted(p.stem for p in ROOT.glob("*.py"))
    assert plain == ["setup"]


# --- each object owns its state: ``x._name`` is read or written only by the class that
# defines ``_name`` (on ``self``, ``cls`` or another instance of that class)

def _class_private_attributes(tree: ast.AST) -> dict[str, set[str]]:
    """Class name -> the private attributes its body defines: methods, class-level names,
    and ``self._x = ...`` / ``cls._x = ...`` assignments in its methods."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        names = out.setdefault(node.name, set())
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(item.name)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                names.add(item.target.id)
            elif isinstance(item, ast.Assign):
                names.update(t.id for t in item.targets if isinstance(t, ast.Name))
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) \
                    and isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls"):
                names.add(sub.attr)
    return {cls: {n for n in names if _private(n)} for cls, names in out.items()}


def foreign_private_accesses(trees: dict[str, ast.AST]) -> list[str]:
    """``x._name`` (read or written) where ``x`` is not ``self`` / ``cls`` and no class
    enclosing the access defines ``_name``, for the ``_name``s a class of the package
    defines: another object's private state. Names no class of ours defines (torch's
    ``Tensor._version``, ``OpOverload._schema``, a module's private function) are not
    the package's objects' state and are left to other checks."""
    owned: dict[str, set[str]] = {}
    for tree in trees.values():
        for cls, names in _class_private_attributes(tree).items():
            owned.setdefault(cls, set()).update(names)
    ours = set().union(*owned.values())
    bad = []

    def visit(node: ast.AST, module: str, enclosing: tuple[str, ...]) -> None:
        if isinstance(node, ast.ClassDef):
            enclosing = (*enclosing, node.name)
        if isinstance(node, ast.Attribute) and node.attr in ours and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")) \
                and not any(node.attr in owned.get(cls, ()) for cls in enclosing) \
                and not ast.unparse(node.value).startswith("torch"):
            bad.append(f"{module}:{node.lineno} {ast.unparse(node)}")
        for child in ast.iter_child_nodes(node):
            visit(child, module, enclosing)

    for module, tree in trees.items():
        visit(tree, module, ())
    return bad


def test_private_state_finder_can_fail() -> None:
    code = ("class A:\n    def __init__(self):\n        self._x = 1\n    def same(self, other):\n"
            "        return other._x\n"
            "class B:\n    def poke(self, a):\n        a._x = 2\n        return a._y\n"
            "def f(a):\n    return a._x, a._version\n")
    assert foreign_private_accesses({"m": ast.parse(code)}) == ["m:8 a._x", "m:11 a._x"]


def test_no_object_touches_another_objects_private_state() -> None:
    """Across the whole package (not only across subpackages): what one object needs of
    another is a public method or property of it (``Guard.attempt``, ``ModeSwitch.pause``...)."""
    trees = {name: ast.parse(path.read_text(), str(path)) for name, (path, _) in source_modules().items()}
    bad = foreign_private_accesses(trees)
    assert not bad, "private state touched from outside its class: " + "; ".join(bad)
