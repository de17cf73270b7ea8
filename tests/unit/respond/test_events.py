"""Structured events (``sdc_guard.respond.events``) and the exit report's devices, written
by real guarded training runs with drilled faults: one process here, two DDP ranks (gloo)
in ``test_ddp_ranks_write_their_own_lines_and_rank_zero_names_the_device_to_drain``. A
failing event target (a full disk, a path under a file, a callable that raises) warns
once and changes nothing else: not the course of training, not the exit code."""

import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch


import sdc_guard  # noqa: E402
from respond_helpers import closure_for, make_model, train  # noqa: E402
from sdc_guard import GemmFault, Policy  # noqa: E402
from sdc_guard.respond.events import ENV_EVENTS, EventLog  # noqa: E402
from sdc_guard.respond.exit_codes import EXIT_CODES, code_for, describe  # noqa: E402

from paths import SUPPORT  # noqa: E402

IDENTITY = {"node", "hostname", "rank", "local_rank", "world_size", "device", "device_uuid", "device_id", "pid"}
COMMON = {"version", "time", "event", "step", "site", "kind", "classification", "action"} | IDENTITY


def lines(path: Path) -> list[dict]:
    return [json.loads(line, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
            for line in path.read_text().splitlines()]


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch) -> str:
    """A scheduler's node name (as Kubernetes' downward API would set it) and torchrun's
    local rank, so the lines must name them and not the host name."""
    monkeypatch.setenv("SDC_GUARD_NODE", "gpu-node-17")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv(ENV_EVENTS, raising=False)
    return "gpu-node-17"


def test_transient_fault_writes_a_detection_then_a_recompute_response(tmp_path: Path, node: str) -> None:
    path = tmp_path / "events.jsonl"
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with sdc_guard.drill(model, GemmFault(site="blocks.0.fc1", phase="forward", step=2)), \
            sdc_guard.protect(model, events=path) as guard:
        outcomes = [guard.optimizer_step(opt, closure_for(model, opt, step)) for step in range(4)]
    assert outcomes[2].classification == "transient"
    events = lines(path)
    assert [(e["event"], e["step"]) for e in events] == [("detection", 2), ("response", 2)]
    detection, response = events
    assert COMMON <= set(detection) and COMMON <= set(response)
    assert {k: detection[k] for k in ("node", "rank", "local_rank", "device", "device_uuid", "device_id")} == \
        {"node": node, "rank": 0, "local_rank": 0, "device": "cpu", "device_uuid": None, "device_id": "cpu"}
    # the detection is written before triage: no classification or action yet
    assert (detection["site"], detection["kind"], detection["op"], detection["phase"]) == \
        ("blocks.0.fc1", "gemm", "addmm", "forward")
    assert (detection["classification"], detection["action"]) == (None, None)
    assert (response["site"], response["kind"], response["classification"], response["action"]) == \
        ("blocks.0.fc1", "gemm", "transient", "recompute")
    assert response["flagged_ranks"] == [0] and response["stepped"] is True and response["reruns"] == 1


def test_persistent_fault_writes_rollback_then_exit_naming_the_device_to_drain(
        tmp_path: Path, node: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_EVENTS, str(tmp_path / "events" / "rank{rank}.jsonl"))  # folder made at the first event
    with pytest.raises(sdc_guard.SDCExit) as info:
        train(make_model(), 8, faults=(GemmFault(site="head", step=3, sticky=True),),
              policy=Policy(exit_report_dir=tmp_path / "report"))
    assert info.value.code == sdc_guard.EXIT_PERSISTENT == info.value.outcome.exit_code
    events = lines(tmp_path / "events" / "rank0.jsonl")
    kinds = [(e["event"], e["step"], e["action"]) for e in events if e["event"] != "detection"]
    assert kinds == [("response", 3, "rollback"), ("response", 4, "exit"), ("exit", 4, "exit")]
    assert {e["step"] for e in events if e["event"] == "detection"} == {3, 4}
    assert all(e["site"] == "head" and e["node"] == node for e in events)
    exit_line = events[-1]
    assert (exit_line["exit_code"], exit_line["scheduler"], exit_line["drain"], exit_line["classification"]) == \
        (17, "exclude", True, "persistent")
    report = json.loads((tmp_path / "report" / "sdc_guard-exit.json").read_text())
    assert report["scheduler"] == "exclude" and report["exclude_nodes"] == [node]
    assert [(d["node"], d["rank"], d["device"]) for d in report["drain"]] == [(node, 0, "cpu")]


def test_observation_only_detections_are_written_without_a_response(tmp_path: Path, node: str) -> None:
    stream_path = tmp_path / "events.jsonl"
    model = make_model()
    with stream_path.open("w") as stream:
        with sdc_guard.drill(model, GemmFault(site="head", phase="forward", step=0)), \
                sdc_guard.protect(model, events=stream):
            model(torch.randint(0, 64, (2, 16))).sum().backward()
    events = lines(stream_path)
    assert [(e["event"], e["site"], e["phase"], e["action"]) for e in events] == \
        [("detection", "head", "forward", None)]


def test_a_callable_target_gets_each_event_as_a_dict(node: str) -> None:
    got: list[dict] = []
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with sdc_guard.drill(model, GemmFault(site="head", step=1)), \
            sdc_guard.protect(model, events=got.append, policy=Policy(on_detection="skip")) as guard:
        for step in range(3):
            guard.optimizer_step(opt, closure_for(model, opt, step))
    assert [(e["event"], e["step"], e["classification"], e["action"]) for e in got] == \
        [("detection", 1, None, None), ("response", 1, "unconfirmed", "skip")]
    json.dumps(got, allow_nan=False)  # strict JSON as handed over


def _failing_targets(tmp_path: Path) -> dict[str, object]:
    (tmp_path / "a-file").write_text("")

    def raising(event: dict) -> None:
        raise OSError(28, "No space left on device")

    return {"disk full": "/dev/full", "path under a file": tmp_path / "a-file" / "events.jsonl",
            "callable that raises": raising}


@pytest.mark.parametrize("what", ["disk full", "path under a file", "callable that raises"])
def test_a_failing_target_warns_once_and_changes_neither_training_nor_the_exit_code(
        tmp_path: Path, node: str, what: str) -> None:
    if what == "disk full" and not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    target = _failing_targets(tmp_path)[what]
    fault = GemmFault(site="head", step=2, sticky=True)

    def run(events: object) -> tuple[int, list]:
        model = make_model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        store = sdc_guard.SnapshotStore(model, opt, every=1)
        losses = []
        with pytest.raises(sdc_guard.SDCExit) as info:
            with sdc_guard.drill(model, fault), \
                    sdc_guard.protect(model, events=events, snapshots=store, policy=Policy()) as guard:
                for step in range(8):
                    losses.append(guard.optimizer_step(opt, closure_for(model, opt, step)).loss.item())
        return info.value.code, losses + [p.detach().clone() for p in model.parameters()]

    code_without, state_without = run(None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code_with, state_with = run(target)
    failures = [w for w in caught if "cannot write events" in str(w.message)]
    assert len(failures) == 1, [str(w.message) for w in caught]  # 5 events failed, 1 warning
    assert code_with == code_without == sdc_guard.EXIT_PERSISTENT
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
               for a, b in zip(state_with, state_without, strict=True))


def test_bad_event_targets_are_named_where_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Linear(4, 2)
    with pytest.raises(TypeError, match="events: expected a file path"):
        sdc_guard.protect(model, events=42)
    with pytest.raises(ValueError, match="events: expected a file path, got .* which is a directory"):
        sdc_guard.protect(model, events=tmp_path)
    monkeypatch.setenv(ENV_EVENTS, str(tmp_path))
    with pytest.raises(ValueError, match=f"{ENV_EVENTS}: expected a file path"):
        sdc_guard.protect(model)
    with pytest.raises(ValueError, match="event: expected one of detection, response, exit"):
        EventLog(tmp_path / "x.jsonl").emit("started")
    with pytest.raises(TypeError, match="heartbeat: expected a callable"):
        Policy(heartbeat="send_heartbeat")


def test_exit_codes_come_from_one_table() -> None:
    assert [e.code for e in EXIT_CODES] == sorted({e.code for e in EXIT_CODES})  # one entry per code
    assert (code_for("transient"), code_for("persistent"), code_for("non_deterministic")) == \
        (sdc_guard.EXIT_TRANSIENT, sdc_guard.EXIT_PERSISTENT, sdc_guard.EXIT_NONDETERMINISTIC)
    assert code_for("unconfirmed") == sdc_guard.EXIT_TRANSIENT
    assert [(c, describe(c).scheduler, describe(c).drain) for c in (16, 17, 18, 19)] == \
        [(16, "requeue", False), (17, "exclude", True), (18, "exclude", True), (19, "exclude", True)]
    assert describe(0) is None and describe(93) is None


# --- heartbeats during re-execution ----------------------------------------------------------


def test_heartbeats_keep_every_replayed_step_within_one_closure_run(node: str) -> None:
    """A hang detector that expects a heartbeat per step sees one at least every closure
    run, however many re-executions and restores a response adds (the user's loop beats
    once per step, here before each optimizer step)."""
    log: list[str] = []
    policy = Policy(reruns=2, heartbeat=lambda: log.append("beat"))
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    store = sdc_guard.SnapshotStore(model, opt, every=1)
    faults = (GemmFault(site="blocks.0.fc1", phase="forward", step=2), GemmFault(site="head", step=4, sticky=True))
    with sdc_guard.drill(model, *faults) as drill, \
            sdc_guard.protect(model, policy=policy, snapshots=store, calibrate_every=None) as guard:
        outcomes = []
        for step in range(6):
            if step == 5:
                drill.remove(faults[1])
            closure = closure_for(model, opt, step)
            log.append("beat")  # the training loop's own heartbeat, once per step

            def counted(closure=closure):
                log.append("closure")
                return closure()

            outcomes.append(guard.optimizer_step(opt, counted))
    assert [(o.classification, o.action) for o in outcomes if o.detected] == \
        [("transient", "recompute"), ("persistent", "rollback")]
    runs = "".join("c" if e == "closure" else "b" for e in log)
    assert "cc" not in runs  # never two closure runs without a heartbeat between them
    assert runs.count("c") == 6 + 2 * 2  # six steps, two of them re-executed twice
    # a rollback beats before and after its restore: after step 4's last re-run, two beats
    assert "cbbbb" in runs


def test_a_failing_heartbeat_warns_once_and_the_response_is_unchanged(node: str) -> None:
    def broken() -> None:
        raise ConnectionError("rank monitor gone")

    def run(heartbeat):
        policy = Policy(heartbeat=heartbeat)
        outcomes, losses, _ = train(make_model(), 5, faults=(GemmFault(site="head", step=1, sticky=True),),
                                    policy=policy, remove_faults_after=2)
        return [(o.classification, o.action, o.rolled_back_to) for o in outcomes], losses

    reference = run(None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run(broken) == reference
    assert len([w for w in caught if "Policy.heartbeat failed" in str(w.message)]) == 1


# --- two DDP ranks ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.corpus  # two DDP processes, about 7 s (CONTRIBUTING.md)
@pytest.mark.slow  # two processes, a gloo process group, a training run each
def test_ddp_ranks_write_their_own_lines_and_rank_zero_names_the_device_to_drain(tmp_path: Path) -> None:
    """Two ranks as torchrun starts them (RANK, LOCAL_RANK, WORLD_SIZE), on two "nodes"
    (SDC_GUARD_NODE); a sticky fault on rank 1 reproduces, is rolled back, reproduces again:
    both ranks exit 17 in lockstep, each wrote its own lines into the one shared file, and
    rank 0's exit report names rank 1's node and device to drain."""
    port = _free_port()
    events = tmp_path / "events.jsonl"
    procs = []
    for rank in range(2):
        env = os.environ | {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "SDC_GUARD_NODE": f"node-{rank}",
                            ENV_EVENTS: str(events), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(SUPPORT / "events_worker.py"), str(tmp_path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [17, 17], outputs
    by_rank = {r: [e for e in lines(events) if e["rank"] == r] for r in range(2)}
    for rank, mine in by_rank.items():
        assert {(e["node"], e["local_rank"], e["world_size"]) for e in mine} == {(f"node-{rank}", rank, 2)}
        responses = [(e["event"], e["step"], e["action"]) for e in mine if e["event"] != "detection"]
        assert responses == [("response", 3, "rollback"), ("response", 4, "exit"), ("exit", 4, "exit")]
    assert not [e for e in by_rank[0] if e["event"] == "detection"]  # rank 0's GEMMs were clean
    assert {e["site"] for e in by_rank[1]} == {"head"}
    assert {e["site"] for e in by_rank[0]} == {None}  # it responded to rank 1's detection
    assert [(e["rank"], e["drain"], e["flagged_ranks"]) for r in range(2) for e in by_rank[r]
            if e["event"] == "exit"] == [(0, False, [1]), (1, True, [1])]
    report = json.loads((tmp_path / "report" / "sdc_guard-exit.json").read_text())
    assert report["exit_code"] == 17 and report["flagged_ranks"] == [1]
    assert [(d["node"], d["rank"], d["local_rank"], d["device"]) for d in report["drain"]] == \
        [("node-1", 1, 1, "cpu")]
    assert report["exclude_nodes"] == ["node-1"]
