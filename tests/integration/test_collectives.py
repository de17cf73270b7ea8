"""The collective checks on real gloo process groups (tests/support/collective_worker.py): the tiny GPT
trained under DDP, FSDP2 and tensor parallelism at 2 and 4 ranks, in fp32 and bf16.

Clean runs report no detection and check every collective of every step; each drill
(``sdc_guard.CollectiveFault``: a zeroed buffer, a flipped bit, stale data, on one rank or
every rank) is caught at the step it fires, on the rank it hits, named by op, link and
bucket or module, classified transient, and the run ends bit-identical to the clean one on
every rank; a fault that stays is rolled back, or exits with code 19 (the link). The
drill tests run 5 steps; the clean runs ``CLEAN_STEPS`` (20 in the suite: about 20 and 40
seconds at 2 and 4 ranks on two cores; ``SDC_GUARD_CLEAN_STEPS=200`` for the 200-step
runs, about 2 and 4 minutes).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch


import collective_worker as worker  # noqa: E402

#: collectives each training step checks, per configuration of the 1-layer tiny GPT:
#: DDP one gradient bucket; FSDP2 the root's and the block's all-gather in the forward,
#: the block's again in the backward (the root stays unsharded), and two reduce-scatters;
#: tensor parallelism the row-parallel fc2's all-reduce forward and fc1's input gradient's
CHECKS_PER_STEP = {"ddp": {"all_reduce": 1}, "fsdp": {"all_gather": 3, "reduce_scatter": 2},
                   "tp": {"all_reduce": 2}}
STEPS = 5
FAULT_STEP = 2
CLEAN_STEPS = int(os.environ.get("SDC_GUARD_CLEAN_STEPS", "20"))


def _run(tmp_path: Path, world_size: int, jobs: list[tuple[str, str, str]], steps: int = STEPS):
    worker.spawn(worker.run, (world_size, worker.free_port(), jobs, steps, str(tmp_path)), world_size,
                 timeout=worker.deadline(len(jobs), steps) + 30)
    return worker.results(tmp_path, world_size)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _check_clean(summaries: list[dict], states: list[dict], key: str, kind: str, world_size: int) -> None:
    for rank in range(world_size):
        got = summaries[rank][key]
        assert [r["detections"] for r in got["reports"]] == [[]] * len(got["reports"]), (rank, key)
        assert all(o["classification"] is None for o in got["outcomes"]), (rank, key)
        expected = sum(CHECKS_PER_STEP[kind].values())
        assert [r["checks"] for r in got["reports"]] == [expected] * len(got["reports"]), (rank, key)
        assert _same(states[rank][key], states[0][key]), (rank, key)  # the replicas agree


def _check_drill(summaries: list[dict], states: list[dict], key: str, clean: str, world_size: int,
                 op: str, receivers: list[int], group_size: int) -> None:
    """Caught at FAULT_STEP on exactly the receivers, by op and link, transient, and the
    run ends as the clean one did, bit for bit, on every rank."""
    for rank in range(world_size):
        got = summaries[rank][key]
        flagged = [(r["step"], d["op"], d["receiver"], d["kind"]) for r in got["reports"] for d in r["detections"]]
        if rank in receivers:
            assert flagged and set(flagged) == {(FAULT_STEP, op, rank, "collective")}, (rank, key, flagged)
            detection = next(d for r in got["reports"] for d in r["detections"])
            if op == "all_gather":
                assert detection["senders"] and set(detection["senders"]) <= set(range(group_size)), (key, detection)
            else:  # a reduction: every rank of the group sent into it
                assert detection["senders"] == list(range(group_size)), (key, detection)
            assert detection["site"], (key, detection)
            assert got["injections"] and got["injections"][0]["step"] == FAULT_STEP and got["injections"][0]["changed"]
        else:
            assert flagged == [], (rank, key, flagged)
        responses = [(o["step"], o["flagged_ranks"], o["classification"], o["action"])
                     for o in got["outcomes"] if o["classification"]]
        assert responses == [(FAULT_STEP, sorted(receivers), "transient", "recompute")], (rank, key, responses)
        assert summaries[rank][key]["reports"][FAULT_STEP]["rerun_detections"] == [0], (rank, key)
        assert _same(states[rank][key], states[rank][clean]), (rank, key)  # re-executed bit for bit


def _drills(kind: str, dtype: str, ops: list[str], receiver: int) -> list[tuple[str, str, str]]:
    return [(kind, dtype, f"{corruption}:{op}:{receiver}:{FAULT_STEP}")
            for op in ops for corruption in ("zero", "flip", "stale")]


@pytest.mark.corpus  # gloo processes, 15-45 s each (CONTRIBUTING.md)
@pytest.mark.slow
def test_ddp_two_ranks_drills_are_caught_transient_and_bit_identical(tmp_path: Path) -> None:
    jobs = [("ddp", "float32", "clean")] + _drills("ddp", "float32", ["all_reduce"], 1) + [
        ("ddp", "float32", f"persistent:all_reduce:1:{FAULT_STEP}"), ("ddp", "float32", f"exit:all_reduce:0:{FAULT_STEP}")]
    summaries, states = _run(tmp_path, 2, jobs)
    clean = "ddp/float32/clean"
    _check_clean(summaries, states, clean, "ddp", 2)
    for _, _, scenario in jobs[1:4]:
        _check_drill(summaries, states, f"ddp/float32/{scenario}", clean, 2, "all_reduce", [1], 2)
    # DDP's bucket is named, and so is the link: every rank sent, rank 1 received
    bucket = next(d for r in summaries[1][f"ddp/float32/flip:all_reduce:1:{FAULT_STEP}"]["reports"] for d in r["detections"])
    assert (bucket["site"], bucket["senders"], bucket["receiver"]) == ("bucket 0", [0, 1], 1)
    # a fault that stays: re-executed, reproduced, rolled back on every rank alike
    persistent = [[(o["step"], o["classification"], o["action"]) for o in s[f"ddp/float32/persistent:all_reduce:1:{FAULT_STEP}"]["outcomes"]
                   if o["classification"]] for s in summaries]
    assert persistent == [[(FAULT_STEP, "persistent", "rollback")]] * 2
    # and with on_persistent="exit": every rank exits with 19, the link's code
    assert [s[f"ddp/float32/exit:all_reduce:0:{FAULT_STEP}"]["exit_code"] for s in summaries] == [19, 19]


@pytest.mark.corpus  # gloo processes, 15-45 s each (CONTRIBUTING.md)
@pytest.mark.slow
def test_fsdp2_two_ranks_all_gather_and_reduce_scatter_drills(tmp_path: Path) -> None:
    jobs = [("fsdp", "float32", "clean")] + _drills("fsdp", "float32", ["all_gather", "reduce_scatter"], 1) + [
        ("fsdp", "float32", f"zero:all_gather:*:{FAULT_STEP}")]
    summaries, states = _run(tmp_path, 2, jobs)
    clean = "fsdp/float32/clean"
    _check_clean(summaries, states, clean, "fsdp", 2)
    for kind, dtype, scenario in jobs[1:-1]:
        op = scenario.split(":")[1]
        _check_drill(summaries, states, f"{kind}/{dtype}/{scenario}", clean, 2, op, [1], 2)
    # the AINIC-SDC-001 case: the first all-gather delivers zeros to every receiver, all
    # receivers agree; each of them sees that neither shard is what its sender sent
    ainic = f"fsdp/float32/zero:all_gather:*:{FAULT_STEP}"
    _check_drill(summaries, states, ainic, clean, 2, "all_gather", [0, 1], 2)
    for rank in range(2):
        detection = next(d for r in summaries[rank][ainic]["reports"] for d in r["detections"])
        assert (detection["senders"], detection["segments"]) == ([0, 1], [0, 1])
        assert detection["site"] == "FSDPTinyGPT"  # the root's parameters: the first all-gather
    # a reduce-scatter is named by the module whose gradients it carries
    sites = {d["site"] for r in summaries[1][f"fsdp/float32/flip:reduce_scatter:1:{FAULT_STEP}"]["reports"]
             for d in r["detections"]}
    assert sites <= {"blocks.0", "FSDPTinyGPT"} and sites


@pytest.mark.corpus  # gloo processes, 15-45 s each (CONTRIBUTING.md)
@pytest.mark.slow
def test_tensor_parallel_two_ranks_dtensor_all_reduce_drills(tmp_path: Path) -> None:
    jobs = [("tp", "float32", "clean")] + _drills("tp", "float32", ["all_reduce"], 0)
    summaries, states = _run(tmp_path, 2, jobs)
    _check_clean(summaries, states, "tp/float32/clean", "tp", 2)
    for kind, dtype, scenario in jobs[1:]:
        _check_drill(summaries, states, f"{kind}/{dtype}/{scenario}", "tp/float32/clean", 2, "all_reduce", [0], 2)
    detection = next(d for r in summaries[0][f"tp/float32/flip:all_reduce:0:{FAULT_STEP}"]["reports"]
                     for d in r["detections"])
    assert detection["site"] == "blocks.0.fc2"  # the row-parallel layer's output


@pytest.mark.corpus  # gloo processes, 15-45 s each (CONTRIBUTING.md)
@pytest.mark.slow
def test_four_ranks_bf16_gradients_ddp_and_fsdp2(tmp_path: Path) -> None:
    jobs = [("ddp", "bfloat16", "clean"), ("ddp", "bfloat16", f"flip:all_reduce:2:{FAULT_STEP}"),
            ("ddp", "bfloat16", f"zero:all_reduce:*:{FAULT_STEP}"),
            ("fsdp", "bfloat16", "clean"), ("fsdp", "bfloat16", f"stale:all_gather:3:{FAULT_STEP}"),
            ("fsdp", "bfloat16", f"flip:reduce_scatter:1:{FAULT_STEP}")]
    summaries, states = _run(tmp_path, 4, jobs)
    for kind in ("ddp", "fsdp"):
        _check_clean(summaries, states, f"{kind}/bfloat16/clean", kind, 4)
    _check_drill(summaries, states, f"ddp/bfloat16/flip:all_reduce:2:{FAULT_STEP}", "ddp/bfloat16/clean", 4,
                 "all_reduce", [2], 4)
    _check_drill(summaries, states, f"ddp/bfloat16/zero:all_reduce:*:{FAULT_STEP}", "ddp/bfloat16/clean", 4,
                 "all_reduce", [0, 1, 2, 3], 4)
    _check_drill(summaries, states, f"fsdp/bfloat16/stale:all_gather:3:{FAULT_STEP}", "fsdp/bfloat16/clean", 4,
                 "all_gather", [3], 4)
    _check_drill(summaries, states, f"fsdp/bfloat16/flip:reduce_scatter:1:{FAULT_STEP}", "fsdp/bfloat16/clean", 4,
                 "reduce_scatter", [1], 4)


@pytest.mark.corpus  # gloo processes, 15-45 s each (CONTRIBUTING.md)
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_clean_runs_stay_clean(tmp_path: Path, world_size: int) -> None:
    """DDP and FSDP2, fp32 and bf16 gradients: every collective of ``CLEAN_STEPS`` steps
    checked (GEMMs unverified, so that only the collective checks run), no detection."""
    jobs = [(kind, dtype, "clean") for kind in ("ddp", "fsdp") for dtype in ("float32", "bfloat16")]
    summaries, states = _run(tmp_path, world_size, jobs, steps=CLEAN_STEPS)
    for kind, dtype, _ in jobs:
        _check_clean(summaries, states, f"{kind}/{dtype}/clean", kind, world_size)
        assert all(r["verified"] == 0 for r in summaries[0][f"{kind}/{dtype}/clean"]["reports"])
        assert all(bool(torch.isfinite(p).all()) for p in states[0][f"{kind}/{dtype}/clean"])  # it trained


@pytest.mark.corpus  # gloo processes, 15-45 s each (CONTRIBUTING.md)
@pytest.mark.slow
def test_the_step_flags_ride_in_the_exchange_and_every_rank_learns_them(tmp_path: Path) -> None:
    """With its collectives checked, a clean step costs the guard one collective: the
    exchange (one all-reduce), no flag all-gather. A GEMM or a collective flagged on rank 1
    only is known to rank 0 from that exchange: both ranks name rank 1 and take the same
    response. Without the checks (``collectives=False``, or a step the sampler does not
    watch) the flags take their own all-gather and still agree."""
    import exchange_worker

    scenarios = ["merged:clean", "merged:gemm", "merged:coll", "off:clean", "off:gemm", "every2:gemm"]
    worker.spawn(exchange_worker.run, (2, worker.free_port(), scenarios, str(tmp_path)), 2,
                 timeout=worker.WORKER_TIMEOUT + 30)
    import json
    summaries = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    fault = exchange_worker.FAULT_STEP
    one_exchange, one_gather = {"all_reduce": 1}, {"all_gather": 1}
    for rank, summary in enumerate(summaries):
        steps = summary["merged:clean"]["steps"]
        assert [s["collectives"] for s in steps] == [one_exchange] * len(steps), (rank, steps)
        assert all(s["checks"] == 1 and s["flagged_ranks"] == [] for s in steps), (rank, steps)
        for scenario in ("merged:gemm", "merged:coll"):
            steps = summary[scenario]["steps"]
            responses = [(s["step"], s["flagged_ranks"], s["classification"], s["action"])
                         for s in steps if s["classification"]]
            assert responses == [(fault, [1], "transient", "recompute")], (rank, scenario, responses)
            assert [s["flagged"] > 0 for s in steps] == [rank == 1 and s["step"] == fault for s in steps]
            # the flags never took their own all-gather; clean steps one collective
            assert all("all_gather" not in s["collectives"] for s in steps), (rank, scenario, steps)
            assert all(s["collectives"] == one_exchange for s in steps if s["step"] != fault), (rank, scenario)
        steps = summary["off:clean"]["steps"]
        assert [s["collectives"] for s in steps] == [one_gather] * len(steps), (rank, steps)
        steps = summary["off:gemm"]["steps"]
        assert [(s["step"], s["flagged_ranks"], s["action"]) for s in steps if s["classification"]] == [
            (fault, [1], "recompute")], (rank, steps)
        assert steps[0]["collectives"] == one_gather and steps[0]["checks"] == 0
        steps = summary["every2:gemm"]["steps"]
        # watched steps (0, 2): the exchange carries the flags; unwatched ones (1, 3): the all-gather
        assert [s["collectives"] for s in steps if s["step"] != fault] == [one_exchange, one_gather, one_gather]
        assert "all_gather" not in steps[fault]["collectives"], (rank, steps)
        assert [(s["step"], s["flagged_ranks"], s["action"]) for s in steps if s["classification"]] == [
            (fault, [1], "recompute")], (rank, steps)
