"""Responses: fault drills, triage by re-execution, recompute, rollback, raise, exit, lockstep."""

import json
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp


import sdc_guard  # noqa: E402
from respond_helpers import closure_for, make_model, params_of, train  # noqa: E402
from sdc_guard import GemmFault, Policy  # noqa: E402

from paths import SUPPORT  # noqa: E402


def test_transient_fault_is_recomputed_and_training_is_bit_identical() -> None:
    clean_model = make_model()
    clean, clean_losses, _ = train(clean_model, 6)
    assert all(o.classification is None and o.stepped for o in clean)

    model = make_model()
    fault = GemmFault(site="blocks.0.attn.qkv", phase="forward", step=3)
    outcomes, losses, _ = train(model, 6, faults=(fault,))
    hit = outcomes[3]
    assert hit.report.flagged == 1 and hit.report.detections[0].site == "blocks.0.attn.qkv"
    assert (hit.classification, hit.action, hit.stepped) == ("transient", "recompute", True)
    assert len(hit.reruns) == 1 and hit.reruns[0].flagged == 0 and hit.reruns[0].attempt == 1
    assert hit.reruns[0].step == hit.step
    assert all(o.classification is None for i, o in enumerate(outcomes) if i != 3)
    assert losses == clean_losses
    assert all(torch.equal(a, b) for a, b in zip(params_of(model), params_of(clean_model)))


def test_backward_fault_is_recomputed_too() -> None:
    clean_model = make_model()
    train(clean_model, 4)
    model = make_model()
    outcomes, _, _ = train(model, 4, faults=(GemmFault(site="head", phase="backward", step=1),))
    assert outcomes[1].report.detections[0].phase == "backward"
    assert outcomes[1].classification == "transient"
    assert all(torch.equal(a, b) for a, b in zip(params_of(model), params_of(clean_model)))


def test_sticky_fault_is_persistent_rolled_back_and_training_converges() -> None:
    model = make_model()
    fault = GemmFault(site="blocks.0.fc2", step=5, sticky=True)
    outcomes, losses, store = train(model, 40, faults=(fault,), remove_faults_after=6, lr=3e-3)
    hit = outcomes[5]
    assert (hit.classification, hit.action, hit.stepped) == ("persistent", "rollback", False)
    assert hit.reruns[0].flagged == hit.report.flagged == 3  # every GEMM of fc2: forward, grad-input, grad-weight
    assert hit.rolled_back_to == 4  # snapshots every 2 steps
    assert all(o.classification is None for o in outcomes[6:])
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.2  # converges after the node "swap"
    assert store.last_good is not None and store.last_good.step > 5


def test_rollback_restores_model_and_optimizer_state_exactly() -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    store = sdc_guard.SnapshotStore(model, opt, every=1)
    policy = Policy(on_detection="rollback")
    with sdc_guard.drill(model, GemmFault(site="head", step=3)), \
            sdc_guard.protect(model, policy=policy, snapshots=store) as guard:
        for step in range(3):
            guard.optimizer_step(opt, closure_for(model, opt, step))
        params, opt_state = params_of(model), {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state_dict()["state"].items()}
        outcome = guard.optimizer_step(opt, closure_for(model, opt, 3))
    assert (outcome.action, outcome.classification, outcome.rolled_back_to) == ("rollback", "unconfirmed", 2)
    assert all(torch.equal(a, b) for a, b in zip(params_of(model), params))
    state = opt.state_dict()["state"]
    assert all(torch.equal(state[k][n], t) for k, v in opt_state.items() for n, t in v.items())


def test_corrupted_weight_in_memory_is_caught_through_the_cache_and_repaired() -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    store = sdc_guard.SnapshotStore(model, opt, every=1)
    with sdc_guard.protect(model, snapshots=store) as guard:
        for step in range(3):
            assert guard.optimizer_step(opt, closure_for(model, opt, step)).classification is None
        hit = sdc_guard.flip_parameter_bit(model, "blocks.0.fc1.weight", (7, 3), bit=30, direction="on")
        assert hit.changed and model.blocks[0].fc1.weight._version == model.blocks[0].fc1.bias._version
        outcome = guard.optimizer_step(opt, closure_for(model, opt, 3))
        after = guard.optimizer_step(opt, closure_for(model, opt, 4))
    sites = {d.site for d in outcome.report.detections}
    assert "blocks.0.fc1" in sites
    assert (outcome.classification, outcome.action, outcome.rolled_back_to) == ("persistent", "rollback", 2)
    assert after.classification is None and after.stepped
    assert store.last_good.step == 4


def test_nondeterministic_reruns_are_recorded_and_skipped() -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    # the original run and the second re-run are hit, the first re-run is clean
    faults = (GemmFault(site="head", phase="forward", step=2, call=0),
              GemmFault(site="head", phase="forward", step=2, call=2))
    with sdc_guard.drill(model, *faults), \
            sdc_guard.protect(model, policy=Policy(reruns=2)) as guard:
        for step in range(2):
            guard.optimizer_step(opt, closure_for(model, opt, step))
        before, state = params_of(model), {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state_dict()["state"].items()}
        outcome = guard.optimizer_step(opt, closure_for(model, opt, 2))
    assert [r.flagged for r in outcome.reruns] == [0, 1]
    assert (outcome.classification, outcome.action, outcome.stepped) == ("non_deterministic", "skip", False)
    assert all(torch.equal(a, b) for a, b in zip(params_of(model), before))  # skip: no update
    after = opt.state_dict()["state"]
    assert all(torch.equal(after[k][n], t) for k, v in state.items() for n, t in v.items())
    assert all(p.grad is None for p in model.parameters())


def test_raise_response_raises_sdc_error_with_the_report() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with pytest.raises(sdc_guard.SDCError) as info:
        with sdc_guard.drill(model, GemmFault(site="head", step=0)), \
                sdc_guard.protect(model, policy=Policy(on_detection="raise")) as guard:
            guard.optimizer_step(opt, closure_for(model, opt, 0))
    assert info.value.report.flagged == 1 and info.value.report.detections[0].site == "head"
    assert "silent data corruption detected at step" in str(info.value)


EXIT_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {here!r})
    import sdc_guard
    from respond_helpers import make_model, train
    policy = sdc_guard.Policy(**{policy}, exit_report_dir={out!r})
    train(make_model(), 6, faults=(sdc_guard.GemmFault(site="head", step=2, sticky=True),), policy=policy)
    print("not reached")
""")


@pytest.mark.parametrize("policy, code, classification", [
    ("{}", sdc_guard.EXIT_PERSISTENT, "persistent"),  # recompute -> rollback -> persistent again -> exit
    ("{'on_detection': 'exit'}", sdc_guard.EXIT_TRANSIENT, "unconfirmed"),
])
@pytest.mark.slow  # integration-heavy (a subprocess, a CLI run, a training loop): see CONTRIBUTING.md
def test_exit_response_exits_with_the_documented_code(tmp_path: Path, policy: str, code: int,
                                                      classification: str) -> None:
    script = EXIT_SCRIPT.format(here=str(SUPPORT), policy=policy, out=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "not reached" not in proc.stdout
    report = json.loads((tmp_path / "sdc_guard-exit.json").read_text(),
                        parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert report["exit_code"] == code and report["classification"] == classification
    assert report["detections"][0]["site"] == "head"


@pytest.mark.slow  # integration-heavy (a subprocess, a CLI run, a training loop): see CONTRIBUTING.md
def test_killed_checkpoint_write_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    sdc_guard.save_checkpoint(path, {"step": 1, "w": torch.arange(10.0)})
    writer = textwrap.dedent(f"""
        import torch, sdc_guard
        big = {{"step": 2, "w": torch.zeros(64, 1024, 1024)}}   # 256 MiB: takes a while to write
        print("writing", flush=True)
        sdc_guard.save_checkpoint({str(path)!r}, big)
        print("done", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    deadline = time.time() + 60
    while not list(tmp_path.glob(".ckpt.pt.tmp-*")) and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    state = sdc_guard.load_checkpoint(path)
    assert state["step"] == 1 and torch.equal(state["w"], torch.arange(10.0))


def test_checkpoints_are_written_atomically_and_restored_after_a_restart(tmp_path: Path) -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    store = sdc_guard.SnapshotStore(model, opt, every=2, keep=2, checkpoint_dir=tmp_path)
    with sdc_guard.protect(model, snapshots=store) as guard:
        for step in range(6):
            guard.optimizer_step(opt, closure_for(model, opt, step))
    names = [p.name for p in store.checkpoints()]  # the initial step-1 one and 0 pruned
    assert names == [f"sdc_guard-{store.run_id}-step2.pt", f"sdc_guard-{store.run_id}-step4.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)
    saved = params_of(model)  # state after step 5; checkpoint 4 is older
    fresh_model = make_model(seed=1)
    fresh_opt = torch.optim.Adam(fresh_model.parameters(), lr=1e-2)
    restored = sdc_guard.SnapshotStore(fresh_model, fresh_opt, checkpoint_dir=tmp_path).restore()
    assert restored.step == 4
    state = sdc_guard.load_checkpoint(store.checkpoint_path(4))
    assert all(torch.equal(p, state["model"][n]) for n, p in fresh_model.state_dict().items())
    assert not torch.equal(params_of(fresh_model)[0], saved[0])
    assert fresh_opt.state_dict()["state"]


def test_drill_arguments_and_stacking_order() -> None:
    model = make_model()
    with pytest.raises(ValueError, match="direction: expected one of"):
        GemmFault(direction="up")
    with pytest.raises(ValueError, match="op: expected a GEMM op"):
        GemmFault(op="conv")
    with pytest.raises(ValueError, match="name: expected a parameter of the model"):
        sdc_guard.flip_parameter_bit(model, "nope")
    with pytest.raises(ValueError, match="on_persistent: expected one of"):
        Policy(on_persistent="recompute")
    with sdc_guard.protect(model):
        with pytest.raises(RuntimeError, match="enter the injector before protect"):
            with sdc_guard.drill(model, GemmFault()):
                pass


def test_drills_are_reproducible_with_a_seed() -> None:
    def run(seed):
        model = make_model()
        with sdc_guard.drill(model, GemmFault(op="addmm", sticky=True), seed=seed) as drill:
            model(torch.randint(0, 64, (2, 16)))
        return [(i.site, i.element, i.bit) for i in drill.injections]

    assert run(3) == run(3) and run(3) != run(4)
    assert len(run(3)) == 5  # qkv, proj, fc1, fc2, head: every addmm of the forward


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.corpus  # gloo processes, 7-12 s (CONTRIBUTING.md)
@pytest.mark.slow
@pytest.mark.parametrize("world_size, scenario", [(2, "transient"), (4, "sticky")])
def test_distributed_lockstep(tmp_path: Path, world_size: int, scenario: str) -> None:
    import ddp_worker

    mp.spawn(ddp_worker.run, args=(world_size, _free_port(), scenario, str(tmp_path)),
             nprocs=world_size, join=True)
    params = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    for other in params[1:]:
        assert all(torch.equal(a, b) for a, b in zip(params[0], other))
    summaries = [json.loads((tmp_path / f"rank{r}.json").read_text())["outcomes"] for r in range(world_size)]
    assert all(s == summaries[0] for s in summaries)  # every rank took the same response
    flagged = [o for o in summaries[0] if o["flagged_ranks"]]
    if scenario == "transient":
        assert [(o["step"], o["flagged_ranks"], o["classification"]) for o in flagged] == [(2, [1], "transient")]
    else:
        assert [(o["step"], o["flagged_ranks"], o["classification"], o["action"], o["rolled_back_to"])
                for o in flagged] == [(3, [world_size - 1], "persistent", "rollback", 2)]


@pytest.mark.corpus  # gloo processes, 7-12 s (CONTRIBUTING.md)
@pytest.mark.slow  # integration-heavy (a subprocess, a CLI run, a training loop): see CONTRIBUTING.md
def test_distributed_checkpoints_are_written_by_rank_zero_and_restored_everywhere(tmp_path: Path) -> None:
    import ddp_worker

    mp.spawn(ddp_worker.run, args=(2, _free_port(), "checkpoints", str(tmp_path)), nprocs=2, join=True)
    def steps(folder: Path) -> list[str]:  # file names without the run id
        return sorted(re.sub(r"^sdc_guard-.*-step", "sdc_guard-step", p.name) for p in folder.iterdir())

    assert steps(tmp_path / "shared") == ["sdc_guard-step2.pt", "sdc_guard-step4.pt"]
    assert steps(tmp_path / "own0") == ["sdc_guard-step9.pt"]
    assert not (tmp_path / "own1").exists() or not list((tmp_path / "own1").iterdir())  # rank 1 wrote nothing
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    saved = sdc_guard.load_checkpoint(next((tmp_path / "shared").glob("sdc_guard-*step4.pt")))["model"]
    assert [r["step"] for r in results] == [4, 4]
    for r in results:
        assert all(torch.equal(p, q) for p, q in zip(r["params"], saved.values()))


def test_sticky_fault_without_filters_hits_2d_and_batched_gemms() -> None:
    model = make_model()
    with sdc_guard.drill(model, GemmFault(sticky=True), seed=1) as faults:
        model(torch.randint(0, 64, (2, 16)))
    ranks = {len(i.element) for i in faults.injections}
    assert ranks == {2, 3}  # mm/addmm outputs and bmm outputs, each at its own fixed position
    assert len(faults.injections) == 7  # every forward GEMM: qkv, proj, fc1, fc2, head, and two bmm


# --- the responder is a passive decider: facts in, a Decision out (respond/responder.py)

def test_responder_state_machine_detection_transitions() -> None:
    """RAN -> TRIAGE -> DONE, with the policy's escalation: every arrow of the docstring's
    detection half, asked with facts alone (no guard, model or optimizer exists here)."""
    from sdc_guard.respond.outcome import EXIT_COLLECTIVE, EXIT_PERSISTENT, EXIT_TRANSIENT, Triage
    from sdc_guard.respond.responder import Act, Responder, State

    responder = Responder(Policy(reruns=2, window=10))
    clean = responder.first_run(3, flagged=[], tripped=[], rerunnable=False)
    assert (clean.state, clean.act, clean.action, clean.classification) == (State.DONE, Act.STEP, None, None)
    triage = responder.first_run(3, flagged=[1], tripped=[], rerunnable=True)
    assert (triage.state, triage.act, triage.reruns, triage.classification) == \
        (State.TRIAGE, Act.RERUN, 2, "unconfirmed")
    transient = responder.after_reruns(triage, 3, Triage.TRANSIENT, [1])
    assert (transient.act, transient.action, transient.classification, transient.resolved) == \
        (Act.STEP, "recompute", "transient", True)
    first = responder.after_reruns(triage, 3, Triage.PERSISTENT, [1])
    assert (first.act, first.classification) == (Act.ROLLBACK, "persistent")
    again = responder.after_reruns(triage, 9, Triage.PERSISTENT, [1])  # within the window
    assert (again.act, again.exit_code, again.link_exit_code) == (Act.EXIT, EXIT_PERSISTENT, EXIT_COLLECTIVE)
    assert responder.policy.persistent_steps == [3, 9]
    nondet = responder.after_reruns(triage, 30, Triage.NON_DETERMINISTIC, [1])
    assert (nondet.act, nondet.resolved, nondet.classification) == (Act.SKIP, True, "non_deterministic")
    # recompute impossible (GEMMs outside the closure): skip, unconfirmed
    outside = responder.first_run(4, flagged=[0], tripped=[], rerunnable=False)
    assert (outside.state, outside.act, outside.action, outside.classification) == \
        (State.DONE, Act.SKIP, "skip", "unconfirmed")
    exits = Responder(Policy(on_detection="exit")).first_run(5, flagged=[0], tripped=[], rerunnable=True)
    assert (exits.act, exits.exit_code, exits.link_exit_code) == (Act.EXIT, EXIT_TRANSIENT, None)
    logs = Responder(Policy(on_detection="log")).first_run(5, flagged=[0], tripped=[], rerunnable=True)
    assert (logs.act, logs.resolved) == (Act.LOG, False)
    with pytest.raises(ValueError, match="pending: expected a RERUN decision"):
        responder.after_reruns(clean, 3, Triage.TRANSIENT, [])


def test_responder_state_machine_screen_transitions() -> None:
    """RAN -> RESCREEN -> DONE for a tripped gradient screen, and the unresolved trip."""
    from sdc_guard.respond.outcome import Triage
    from sdc_guard.respond.responder import Act, Responder, State

    responder = Responder(Policy())
    rescreen = responder.first_run(7, flagged=[], tripped=[0], rerunnable=True)
    assert (rescreen.state, rescreen.act, rescreen.classification) == (State.RESCREEN, Act.RERUN, None)
    miss = responder.after_reruns(rescreen, 7, Triage.CLEAN, [0])
    assert (miss.act, miss.screen, miss.classification, miss.screen_with_gradients) == (Act.STEP, "miss", None, False)
    transient = responder.after_reruns(rescreen, 7, Triage.TRANSIENT, [0])
    assert (transient.act, transient.action, transient.screen, transient.screen_with_gradients) == \
        (Act.STEP, "recompute", "transient", True)
    persistent = responder.after_reruns(rescreen, 7, Triage.PERSISTENT, [0])
    assert (persistent.act, persistent.screen) == (Act.ROLLBACK, "persistent")
    unresolved = responder.first_run(8, flagged=[], tripped=[0], rerunnable=False)
    assert (unresolved.act, unresolved.screen, unresolved.classification) == (Act.SKIP, "unresolved", "unconfirmed")
    logged = Responder(Policy(on_detection="log")).after_reruns(rescreen, 7, Triage.TRANSIENT, [0])
    assert (logged.act, logged.action) == (Act.LOG, "log")


def test_triage_classification_is_a_pure_function_of_the_runs() -> None:
    from sdc_guard.respond.outcome import Triage
    from sdc_guard.respond.responder import classify_detection, classify_rescreen

    a, b = [torch.ones(2)], [torch.zeros(2)]
    flagged = frozenset({("fc", "forward", "mm", (0,), (0,))})
    assert classify_detection(flagged, [frozenset()], []) == Triage.TRANSIENT
    assert classify_detection(flagged, [frozenset(), frozenset()], [a, b]) == Triage.NON_DETERMINISTIC
    assert classify_detection(flagged, [flagged], []) == Triage.PERSISTENT
    assert classify_detection(frozenset(), [frozenset()], []) == Triage.CLEAN
    assert classify_rescreen(a, [frozenset()], [], a) == Triage.CLEAN
    assert classify_rescreen(a, [frozenset()], [], b) == Triage.TRANSIENT
    assert classify_rescreen(a, [flagged, flagged], [a, a], a) == Triage.PERSISTENT
