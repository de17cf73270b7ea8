"""Module paths of a protected model, for the compiled route's sites (docs/COMPILE.md).

A check node in a compiled graph knows its site from the graph: the innermost module of
the node's module stack (``nn_module_stack``, which dynamo keys by the module's ``id``)
that is one of the model's, named by ``of_module_id``. Dynamo may share a frame's graphs
between instances of a module (a block whose ``forward`` has a graph break: parameters
are graph inputs), so that name is the instance traced first; a GEMM with a parameter
operand names its instance at run time: the module that owns the parameter (``owners``).
"""

from __future__ import annotations

from torch import Tensor, nn

from ..checking.cache import storage_address


def _clean(name: str) -> str:
    """``name`` without ``torch.compile``'s wrapper component (``_orig_mod``)."""
    return ".".join(part for part in name.split(".") if part and part != "_orig_mod")


class ModuleNames:
    """``model``'s module paths by module and by parameter storage, built on first use (a
    guard per step pays for it in the steps that ask)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._modules: dict[int, str] | None = None
        self._owners: dict[int, tuple[str, ...]] | None = None  #: by storage address
        self._by_id: dict[int, tuple[Tensor, tuple[str, ...]]] = {}  #: by parameter object (what graphs pass)

    def of_module_id(self, ident: int) -> str | None:
        """The path of the module whose ``id`` is ``ident`` (how dynamo keys a graph node's
        ``nn_module_stack``; ``""`` for the model itself), or ``None`` for a module outside
        the model. Reads no tensor: it is asked while a graph compiles."""
        if self._modules is None:
            self._modules = {}
            for name, m in self.model.named_modules(remove_duplicate=False):
                self._modules.setdefault(id(m), _clean(name))
        return self._modules.get(ident)

    def owners(self, t: Tensor) -> tuple[str, ...]:
        """The paths of the modules whose parameter ``t`` is (or views): more than one for
        a tied weight; empty for anything else. Asked at run time, for every check: the
        parameter object itself (what a compiled graph hands its ops) is found by identity,
        anything else by its storage."""
        if self._owners is None:
            owners: dict[int, tuple[str, ...]] = {}
            params: list[Tensor] = []
            for name, module in self.model.named_modules(remove_duplicate=False):
                clean = _clean(name)
                for p in module.parameters(recurse=False):
                    address = storage_address(p)
                    if address is not None and clean not in owners.get(address, ()):
                        owners[address] = (*owners.get(address, ()), clean)
                    params.append(p)
            self._owners = owners
            self._by_id = {id(p): (p, owners.get(storage_address(p) or 0, ())) for p in params}
        entry = self._by_id.get(id(t))
        if entry is not None and entry[0] is t:
            return entry[1]
        address = storage_address(t)
        return () if address is None else self._owners.get(address, ())


def run_time_site(site: str, owners: tuple[str, ...]) -> str:
    """The site of a GEMM whose trace-time site is ``site`` and whose parameter operand
    belongs to ``owners``: ``site`` when it is one of them (or there are none), else the
    owner that ends in the same module as ``site`` (another instance of the module the
    graph was traced for), else ``site`` (a module that multiplies by a parameter of one
    of its children).

    >>> run_time_site("blocks.0.fc", ("blocks.1.fc",)), run_time_site("lm_head", ("wte", "lm_head"))
    ('blocks.1.fc', 'lm_head')
    >>> run_time_site("attn", ("attn.qkv",))
    'attn'
    """
    if not owners or site in owners:
        return site
    last = site.rsplit(".", 1)[-1]
    same = [o for o in owners if o.rsplit(".", 1)[-1] == last]
    if not same:
        return site
    prefix = site.split(".")
    return max(same, key=lambda o: sum(1 for x, y in zip(reversed(o.split(".")), reversed(prefix)) if x == y))
