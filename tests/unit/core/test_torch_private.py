"""The private torch APIs the package relies on are named in one module,
``sdc_guard/core/torch_private.py``: no other module of the package uses a private torch
name (a ``_`` component of a ``torch`` path), and every name there resolves on the
installed torch."""

from __future__ import annotations

import ast
import re
from typing import Iterator

import pytest
import torch

from sdc_guard.core import torch_private

from paths import ROOT  # noqa: E402

PACKAGE = ROOT / "sdc_guard"
HOME = PACKAGE / "core" / "torch_private.py"
#: a whole string that is a private torch path (a module named by its dotted name)
PRIVATE_PATH = re.compile(r"torch(\.\w+)*\._\w+(\.\w+)*")


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _is_private_path(path: str) -> bool:
    parts = path.split(".")
    return parts[0] == "torch" and any(_private(p) for p in parts[1:])


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; ``None`` where the root is not a name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def private_torch_uses(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, dotted path) of each private torch name ``source`` imports, reads through
    ``torch`` (or a name bound to a torch module or object) or spells as a string; an
    attribute chain counts once, at its outermost attribute."""
    tree = ast.parse(source, filename)
    bound: dict[str, str] = {}  # local name -> the torch path it stands for
    found: set[tuple[int, str]] = set()
    inner: set[int] = set()  # attributes that are the value of another attribute
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            inner.add(id(node.value))
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    if _is_private_path(alias.name):
                        found.add((node.lineno, alias.name))
                    bound[alias.asname or "torch"] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if _is_private_path(full):
                    found.add((node.lineno, full))
                bound[alias.asname or alias.name] = full
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            chain = _chain(node)
            if chain and chain[0] in bound:
                full = ".".join([bound[chain[0]], *chain[1:]])
                if _is_private_path(full):
                    found.add((node.lineno, full))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and PRIVATE_PATH.fullmatch(node.value):
            found.add((node.lineno, node.value))
    return sorted(found)


def test_the_scan_finds_each_spelling() -> None:
    """The check below can fail: each way of reaching a private torch name is found, and
    public ones are not."""
    code = ("import torch\nimport torch._dynamo\nfrom torch.utils._python_dispatch import TorchDispatchMode\n"
            "from torch.overrides import _get_current_function_mode\nimport torch.fx as fx\n"
            "x = torch._C._len_torch_dispatch_stack()\ny = fx.node._side_effectful_functions\n"
            "z = 'torch._subclasses.fake_tensor'\nok = torch.nn.functional.linear\nok2 = torch.ops.aten.mm\n")
    found = {name for _, name in private_torch_uses(code)}
    assert {"torch._dynamo", "torch.utils._python_dispatch.TorchDispatchMode",
            "torch.overrides._get_current_function_mode", "torch._subclasses.fake_tensor",
            "torch.fx.node._side_effectful_functions"} <= found
    assert any(name.startswith("torch._C._len_torch_dispatch_stack") for name in found)
    assert not any("functional" in name or "aten" in name for name in found), found


def test_no_module_uses_a_private_torch_name_outside_torch_private() -> None:
    bad = [f"{path.relative_to(PACKAGE.parent)}:{line} {name}"
           for path in sorted(PACKAGE.rglob("*.py")) if path != HOME
           for line, name in private_torch_uses(path.read_text(), str(path))]
    assert not bad, "private torch names outside sdc_guard/core/torch_private.py: " + "; ".join(bad)


@pytest.mark.parametrize("name", torch_private.__all__)
def test_every_name_resolves_on_this_torch(name: str) -> None:
    """Each name is there on the installed torch (an upgrade that moves one fails here,
    by name, rather than deep inside a guarded step)."""
    assert getattr(torch_private, name) is not None


def test_this_torch_is_one_the_names_were_checked_on() -> None:
    """A torch not in ``TESTED_TORCH``: check each name's use there, then add it."""
    assert torch.__version__.split("+")[0] in torch_private.TESTED_TORCH, torch_private.TESTED_TORCH
