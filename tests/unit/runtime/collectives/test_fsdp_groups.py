"""Which FSDP2 parameter group issued a collective (``fsdp_groups.fsdp_module``): found on
the stack at any depth, at remembered depths first, never a group that is not there."""

import sys

import pytest

from sdc_guard.runtime.collectives import fsdp_groups
from sdc_guard.runtime.collectives.fsdp_groups import fsdp_module


class FSDPParamGroup:
    """A stand-in with FSDP2's names: ``unshard`` and ``post_backward`` issue collectives."""

    def __init__(self, name: str) -> None:
        self.modules = [name]

    def unshard(self, levels: int) -> object:
        return _nested(levels)

    def post_backward(self, levels: int) -> object:
        return _nested(levels)


def _nested(levels: int) -> object:
    """``fsdp_module`` as the checks call it, ``levels`` Python frames below the caller."""
    return _nested(levels - 1) if levels else _label()


def _label() -> object:  # the checks' ``_label``: the frame right above ``fsdp_module``
    return fsdp_module()


@pytest.fixture
def fresh_depths(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    monkeypatch.setitem(sys.modules, "torch.distributed.fsdp", sys.modules.get("torch.distributed.fsdp", sys))
    depths: list[int] = []
    monkeypatch.setattr(fsdp_groups, "_FSDP_DEPTHS", depths)
    return depths


def test_the_group_is_found_at_any_depth_and_its_depth_remembered(fresh_depths: list[int]) -> None:
    assert FSDPParamGroup("blocks.0").unshard(5) == "blocks.0"
    assert FSDPParamGroup("blocks.1").post_backward(9) == "blocks.1"
    assert fresh_depths == [7, 11]  # _label, _nested x levels+1, then the group's frame
    # a remembered depth is looked at first, the others still found by the walk
    assert FSDPParamGroup("root").unshard(9) == "root"
    assert FSDPParamGroup("blocks.2").unshard(2) == "blocks.2"
    assert fresh_depths == [4, 7, 11]


def test_no_group_on_the_stack_is_none_even_where_a_depth_is_remembered(fresh_depths: list[int]) -> None:
    assert FSDPParamGroup("blocks.0").unshard(5) == "blocks.0"

    class Other:  # the same method name on another class: not a group
        modules = ["x"]

        def unshard(self, levels: int) -> object:
            return _nested(levels)

    assert Other().unshard(5) is None
    assert _nested(5) is None and _nested(0) is None
    assert fresh_depths == [7]


def test_a_process_without_fsdp2_walks_no_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch.distributed.fsdp", raising=False)
    assert FSDPParamGroup("blocks.0").unshard(3) is None
