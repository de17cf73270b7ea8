"""protect() under PyTorch's sharded training: FSDP2 (``fully_shard``) and tensor parallelism.

Real gloo process groups on CPU (tests/fsdp_worker.py), the tiny GPT of tests/models.py:
clean training is verified GEMM by GEMM and changes nothing, a transient fault on one rank
is re-executed by all ranks and leaves the run bit-identical to a clean one, a persistent
fault rolls every rank back to the sharded snapshot (parameters and Adam moments).
Sharded checkpoints (DCP directories every rank writes) restore every rank's shards bit
for bit, after a restart too, and a disk that fails on one rank fails the write on all.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from sdc_guard.runtime.checking.cache import WeightCache, storage_address


#: GEMMs of one training step of the 1-layer tiny GPT: 7 in the forward (qkv, q@k, att@v,
#: proj, fc1, fc2, head), 14 in the backward; sharding changes where they run, not how many.
GEMMS_PER_STEP = 21
#: the same under activation checkpointing, compiled: the backward runs the block's six
#: forward GEMMs again (the head is not checkpointed)
GEMMS_PER_STEP_AC = GEMMS_PER_STEP + 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(tmp_path: Path, kind: str, world_size: int, scenarios: tuple[str, ...]) -> tuple[list, list]:
    import fsdp_worker

    mp.spawn(fsdp_worker.run, args=(world_size, _free_port(), kind, scenarios, str(tmp_path)),
             nprocs=world_size, join=True)
    states = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    summaries = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]
    return states, summaries


def _same(a: dict, b: dict) -> bool:
    """Bit-for-bit equality of two gathered states (parameters and Adam moments)."""
    return (len(a["params"]) == len(b["params"]) and len(a["moments"]) == len(b["moments"])
            and all(torch.equal(x, y) for x, y in zip(a["params"] + a["moments"], b["params"] + b["moments"])))


def _check(states: list, summaries: list, world_size: int, *, cached: bool, gemms: int = GEMMS_PER_STEP) -> None:
    scenarios = list(summaries[0])
    for rank in range(world_size):
        for scenario in scenarios:
            # every rank ends every scenario in the same full state
            assert _same(states[rank][scenario][-1], states[0][scenario][-1]), (rank, scenario)
            if scenario == "bare":
                continue
            reports = summaries[rank][scenario]["reports"]
            assert [(r["seen"], r["verified"], r["unverified"]) for r in reports] == \
                [(gemms, gemms, {})] * len(reports)
            # FSDP2's gathered weights are never cached; tensor-parallel shards are
            assert (reports[-1]["cache_hits"] > 0) == cached
            flagged = [(i, r["flagged"] > 0) for i, r in enumerate(reports) if r["flagged"]]
            expected = {"clean": [], "transient": [(2, True)] if rank == 1 else [],
                        "persistent": [(3, True)] if rank == world_size - 1 else []}[scenario]
            assert flagged == expected, (rank, scenario)
        # every rank took the same response
        assert {s: summaries[rank][s]["outcomes"] for s in scenarios} == \
            {s: summaries[0][s]["outcomes"] for s in scenarios}
    outcomes = summaries[0]
    responses = {s: [(o["step"], o["flagged_ranks"], o["classification"], o["action"], o["rolled_back_to"])
                     for o in outcomes[s]["outcomes"] if o["flagged_ranks"]] for s in scenarios if s != "bare"}
    assert responses["clean"] == []
    assert responses["transient"] == [(2, [1], "transient", "recompute", None)]
    if "persistent" in responses:
        assert responses["persistent"] == [(3, [world_size - 1], "persistent", "rollback", 2)]
    ours = states[0]
    if "bare" in ours:  # the guard changes nothing in a clean run
        assert all(_same(a, b) for a, b in zip(ours["clean"], ours["bare"]))
    assert _same(ours["transient"][-1], ours["clean"][-1])  # re-executed bit for bit
    if "persistent" in ours:  # the rollback at step 3 returned every shard to the snapshot of step 2
        assert _same(ours["persistent"][3], ours["clean"][2])
        assert not _same(ours["persistent"][2], ours["clean"][1])  # (a state that moved)


@pytest.mark.corpus  # gloo processes, 10-30 s each (CONTRIBUTING.md)
@pytest.mark.slow
def test_fsdp2_two_ranks(tmp_path: Path) -> None:
    states, summaries = _spawn(tmp_path, "fsdp", 2, ("bare", "clean", "transient", "persistent"))
    _check(states, summaries, 2, cached=False)


@pytest.mark.corpus  # gloo processes, 10-30 s each (CONTRIBUTING.md)
@pytest.mark.slow
def test_fsdp2_compiled_with_activation_checkpointing_two_ranks(tmp_path: Path) -> None:
    """torchtitan's stack: every block checkpointed and compiled, FSDP2 over them. Every
    local GEMM is checked in the compiled graphs (the recomputed ones in the backward
    included), a clean run detects nothing and changes nothing, a transient fault in a
    recomputed GEMM on one rank is re-executed by every rank back to the clean weights."""
    states, summaries = _spawn(tmp_path, "fsdp_compile", 2, ("bare", "clean", "transient"))
    assert all(r["compiled"] for rank in summaries for s in ("clean", "transient") for r in rank[s]["reports"])
    _check(states, summaries, 2, cached=False, gemms=GEMMS_PER_STEP_AC)


@pytest.mark.corpus  # gloo processes, 10-30 s each (CONTRIBUTING.md)
@pytest.mark.slow
def test_fsdp2_four_ranks(tmp_path: Path) -> None:
    states, summaries = _spawn(tmp_path, "fsdp", 4, ("clean", "transient", "persistent"))
    _check(states, summaries, 4, cached=False)


@pytest.mark.corpus  # gloo processes, 10-30 s each (CONTRIBUTING.md)
@pytest.mark.slow
def test_tensor_parallel_two_ranks(tmp_path: Path) -> None:
    states, summaries = _spawn(tmp_path, "tp", 2, ("bare", "clean", "transient", "persistent"))
    _check(states, summaries, 2, cached=True)


def _check_checkpoints(tmp_path: Path, world_size: int) -> None:
    """What ``fsdp_worker.checkpoints`` did, on every rank (see its numbered phases)."""
    states = [torch.load(tmp_path / f"rank{r}-checkpoints.pt") for r in range(world_size)]
    infos = [json.loads((tmp_path / f"rank{r}-checkpoints.json").read_text()) for r in range(world_size)]
    info, clean = infos[0], states[0]["clean"]
    run, last = info["run_id"], len(clean) - 1
    name = (lambda step: f"sdc_guard-{run}-step{step}.dcp")
    assert not _same(clean[last - 1], clean[last - 2])  # (states that move)
    # 1. one run id (rank 0's, the ranks made their own), keep=2, no temporaries left
    assert [i["run_id"] for i in infos] == [run] * world_size
    assert info["files"] == [name(last - 3), name(last - 1)]
    contents = info["contents"]
    assert {".metadata", "sdc_guard.json"} | {f"rank{r}.pt" for r in range(world_size)} <= set(contents)
    assert any(n.endswith(".distcp") for n in contents)
    for rank in range(world_size):
        got, mine = infos[rank], states[rank]
        # every rank's view is the full state, the same on all ranks
        # 2. in-memory snapshots dropped: the newest checkpoint, bit for bit
        assert got["restored"] == last - 1 and _same(mine["restored"], clean[last - 1]), rank
        # 3. the restart: the garbage copy skipped by all ranks, the persistent fault
        #    rolled back from disk, then the step done again as in the clean run
        assert got["temporaries"] == []  # the killed writer's directory went when the store opened
        assert got["outcomes"] == [[last, [world_size - 1], "persistent", "rollback", last - 1],
                                   [last + 1, [], None, None, None]], rank
        assert _same(mine["rolled_back"], clean[last - 1]) and _same(mine["resumed"], clean[last]), rank
        skipped = [m for m in got["skipped"] if name(last + 1) in m]
        assert len(skipped) == 1 and "reading" in skipped[0] and "rank 0:" in skipped[0], got["skipped"]
        assert any(name(last + 2) in m and "not a complete checkpoint directory" in m
                   for m in got["skipped"]) == (rank == 0)  # rank 0's listing decides
        # the write after the rollback replaced the garbage copy; the oldest pruned; a
        # directory that never finished is never deleted
        assert got["files_after_restart"] == [name(last - 1), name(last + 1), name(last + 2)]
        # 4. a new run id: the newest readable checkpoint of any run (the one just written)
        assert got["any_run"] == last + 1 and _same(mine["any_run"], clean[last]), rank
        # 5. rank 1's full disk: the same error on every rank, one warning each, no step lost
        disk = got["disk"]
        assert disk["errors"] == info["disk"]["errors"]
        for error in disk["errors"]:
            # (DCP's writer names the cause when a tensor's write fails; when torch.save
            # writes a non-tensor value, all that is left of it is a write cut short)
            assert "rank 1:" in error and re.search("the disk is full|as on a full disk", error), error
            assert "rank 0:" not in error
        assert len(disk["warnings"]) == 2 and disk["stepped"] == [True] * 3 and disk["last_good"] == 2
        assert disk["files"] == ["sdc_guard-full-step-1.dcp", "sdc_guard-full-step0.dcp"]
        assert disk["files_small"] == []  # the failed write's temporary directory removed
        assert disk["restored"] == 0 and _same(mine["disk_restored"], clean[0])
        assert _same(mine["disk_last"], clean[2])


@pytest.mark.corpus  # gloo processes, 10-30 s each (CONTRIBUTING.md)
@pytest.mark.slow
def test_fsdp2_sharded_checkpoints_two_ranks(tmp_path: Path) -> None:
    _spawn(tmp_path, "fsdp", 2, ("checkpoints",))
    _check_checkpoints(tmp_path, 2)


@pytest.mark.corpus  # gloo processes, 10-30 s each (CONTRIBUTING.md)
@pytest.mark.slow
def test_tensor_parallel_sharded_checkpoints_two_ranks(tmp_path: Path) -> None:
    _spawn(tmp_path, "tp", 2, ("checkpoints",))
    _check_checkpoints(tmp_path, 2)


def test_storage_address_of_freed_and_storageless_tensors() -> None:
    """FSDP2 frees an unsharded parameter by resizing its storage to nothing: such a
    tensor, like a meta tensor, has no address, so it is never registered or cached."""
    w = torch.nn.Parameter(torch.randn(8, 4))
    freed = torch.empty(8, 4)
    freed.untyped_storage().resize_(0)
    assert storage_address(w) == w.untyped_storage().data_ptr()
    assert storage_address(freed) is None and storage_address(torch.empty(2, device="meta")) is None
    cache = WeightCache()
    cache.set_parameters([w, freed])
    assert cache.is_cacheable(w.t()) and not cache.is_cacheable(freed)
    assert cache.get(freed) is None and cache.stats.uncacheable == 1
