"""Known-good state and exit paths on a real disk: stale and corrupt directories, writers
killed mid-write, a directory the process may not write (as a non-root user), a full disk
(``RLIMIT_FSIZE``), exit reports that cannot be written; strict JSON; warn-once across
per-step blocks; drills that cannot fire.

Tests run as root here and in CI, and root ignores permission bits: the unwritable
directory is exercised in a subprocess run as ``nobody`` (uid 65534) through ``setpriv``,
keeping only ``CAP_DAC_READ_SEARCH`` so that the process can read the interpreter and
packages wherever they are installed (under root's home, say) while writes obey the
permission bits like any user's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch import nn


import sdc_guard  # noqa: E402
from respond_helpers import closure_for, make_model  # noqa: E402
from sdc_guard import GemmFault, Policy, SnapshotStore  # noqa: E402
from sdc_guard.respond.snapshot import CHECKPOINT_PATTERN, host_label, remove_stale_temporaries  # noqa: E402

from paths import SUPPORT  # noqa: E402

NOBODY = 65534


def strict_loads(text: str):
    """``json.loads`` that rejects ``Infinity`` / ``NaN`` like JavaScript's parser does."""
    def reject(constant: str):
        raise ValueError(f"not strict JSON: {constant}")
    return json.loads(text, parse_constant=reject)


def run_python(script: str, *args: str, user: int | None = None, env: dict | None = None,
               timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter (as ``user`` through setpriv, if given)."""
    command = [sys.executable, "-c", script, *map(str, args)]
    if user is not None and os.geteuid() == 0:
        command = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups",
                   "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search", *command]
    full_env = {**os.environ, "PYTHONPATH": str(SUPPORT), "PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=full_env)


def require_setpriv() -> None:
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        message = "setpriv (util-linux) is needed to test an unwritable directory as a non-root user"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


def stored_steps(directory: Path, run: str | None = None) -> list[int]:
    return sorted(int(m["step"]) for p in directory.iterdir()
                  if (m := CHECKPOINT_PATTERN.match(p.name)) and (run is None or m["run"] == run))


def temporaries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# --- checkpoints that belong to a run ------------------------------------------------------


def test_an_earlier_runs_directory_never_costs_this_run_its_newest_checkpoints(tmp_path: Path) -> None:
    """An earlier run left step5000 and step5050 (and a file of the format before run ids,
    step5100): this run keeps its own two newest, leaves theirs alone, and a restart,
    under its own run id or a new one, restores this run's state, not theirs."""
    old_model = make_model(seed=1)
    old = SnapshotStore(old_model, every=1, checkpoint_dir=tmp_path, run_id="earlier")
    old.take(5000), old.take(5050)
    sdc_guard.save_checkpoint(tmp_path / "sdc_guard-step5100.pt", {"step": 5100, "model": old_model.state_dict()})
    an_hour_ago = time.time() - 3600
    for path in tmp_path.iterdir():
        os.utime(path, (an_hour_ago, an_hour_ago))
    foreign = sorted(p.name for p in tmp_path.iterdir())

    model = make_model(seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    store = SnapshotStore(model, opt, every=1, keep=2, checkpoint_dir=tmp_path, run_id="this")
    with sdc_guard.protect(model, snapshots=store) as guard:
        for step in range(4):
            guard.optimizer_step(opt, closure_for(model, opt, step))
    after_step_3 = weights(model)

    assert stored_steps(tmp_path, "this") == [2, 3]  # the initial step -1, 0 and 1 pruned
    assert sorted(p.name for p in tmp_path.iterdir() if "-this-" not in p.name) == foreign  # untouched
    for run_id in ("this", None):  # a restart of this run; a restart that got a new run id
        fresh = make_model(seed=2)
        restored = SnapshotStore(fresh, torch.optim.Adam(fresh.parameters()), checkpoint_dir=tmp_path,
                                 run_id=run_id).restore()
        assert restored.step == 3
        assert all(torch.equal(a, b) for a, b in zip(weights(fresh), after_step_3))


def test_unreadable_checkpoints_are_skipped_with_a_warning_and_never_counted(tmp_path: Path) -> None:
    model = nn.Linear(8, 8)
    store = SnapshotStore(model, every=1, keep=2, checkpoint_dir=tmp_path, run_id="run")
    for step in (0, 1):
        with torch.no_grad():
            model.weight.fill_(step)
        store.take(step)
    good = store.checkpoint_path(1).read_bytes()
    store.checkpoint_path(7).write_bytes(b"")  # zero-length
    store.checkpoint_path(8).write_bytes(os.urandom(2048))  # garbage
    store.checkpoint_path(9).write_bytes(good[: len(good) // 2])  # a copy cut short
    with zipfile.ZipFile(store.checkpoint_path(10), "w") as archive:  # complete zip, bad pickle
        archive.writestr("archive/data.pkl", b"not a pickle")

    restart = SnapshotStore(model, every=1, keep=2, checkpoint_dir=tmp_path, run_id="run")
    with pytest.warns(RuntimeWarning, match="skipping checkpoint") as caught:
        restored = restart.restore()
    assert restored.step == 1 and torch.all(model.weight == 1)
    skipped = {Path(str(w.message).split("skipping checkpoint ")[1].split(":")[0]).name for w in caught}
    assert skipped == {f"sdc_guard-run-step{s}.pt" for s in (7, 8, 9, 10)}

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # each bad file warned about once, not at every listing
        restart.take(2)  # keep=2 counts readable checkpoints only: 1 and 2 stay
    assert stored_steps(tmp_path) == [1, 2, 7, 8, 9, 10]


def test_stale_temporaries_go_and_live_writers_keep_theirs(tmp_path: Path) -> None:
    """Only the temporary files of writers that are gone are removed: a dead process's,
    this process id's from before the run (a reused id), an unknown host's once old."""
    live = subprocess.Popen(["sleep", "60"])
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    try:
        names = {
            "dead": f".sdc_guard-r-step3.pt.tmp-{host_label()}-{int(dead.stdout)}",
            "dead_old_format": f".sdc_guard-step3.pt.tmp-{int(dead.stdout)}",
            "live": f".sdc_guard-r-step4.pt.tmp-{host_label()}-{live.pid}",
            "mine_before_run": f".sdc_guard-r-step5.pt.tmp-{host_label()}-{os.getpid()}",
            "other_host_fresh": f".sdc_guard-r-step6.pt.tmp-elsewhere-{live.pid}",
            "other_host_old": f".sdc_guard-r-step7.pt.tmp-elsewhere-{live.pid + 1}",
            "not_ours": ".notes.tmp-1",
        }
        for name in names.values():
            (tmp_path / name).write_bytes(b"partial")
        started = time.time() + 1
        two_hours_ago = started - 7200
        os.utime(tmp_path / names["other_host_old"], (two_hours_ago, two_hours_ago))
        removed = {p.name for p in remove_stale_temporaries(tmp_path, started)}
        assert removed == {names[k] for k in ("dead", "dead_old_format", "mine_before_run", "other_host_old")}
        assert {p.name for p in tmp_path.iterdir()} == {names[k] for k in ("live", "other_host_fresh", "not_ours")}
    finally:
        live.kill()
        live.wait()


KILL_WRITER = textwrap.dedent("""
    import sys, torch, sdc_guard
    directory, first = sys.argv[1], int(sys.argv[2])
    model = torch.nn.Linear(2048, 2048, bias=False)   # 16 MiB: a write takes a while
    store = sdc_guard.SnapshotStore(model, every=1, keep=2, checkpoint_dir=directory, run_id="killed")
    print("ready", flush=True)
    for step in range(first, first + 1000):
        with torch.no_grad():
            model.weight.fill_(float(step))
        store.take(step)
        print(step, flush=True)
""")


@pytest.mark.corpus  # processes killed mid-write, about 11 s (CONTRIBUTING.md)
@pytest.mark.slow
def test_writers_killed_mid_write_leave_no_torn_checkpoint_and_no_temporaries(tmp_path: Path) -> None:
    """Five writers killed with SIGKILL while writing: every checkpoint on disk is whole
    (its weights all equal its step), each restart removes the dead writer's temporary
    file, and restore() returns the newest whole checkpoint."""
    kills = torn = 0
    for round_ in range(5):
        proc = subprocess.Popen([sys.executable, "-c", KILL_WRITER, str(tmp_path), str(100 * round_)],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            assert temporaries(tmp_path) == []  # the previous round's killed writer's file is gone
            completed = int(proc.stdout.readline())  # at least one whole checkpoint of this writer
            deadline = time.time() + 60
            while not temporaries(tmp_path) and time.time() < deadline:
                time.sleep(0.001)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(timeout=60)
        kills += proc.returncode == -signal.SIGKILL
        left = temporaries(tmp_path)
        assert len(left) <= 1
        torn += len(left)
        for path in tmp_path.glob("sdc_guard-*.pt"):
            state = sdc_guard.load_checkpoint(path)
            assert torch.all(state["model"]["weight"] == state["step"]), path.name
        reader = nn.Linear(2048, 2048, bias=False)
        restored = SnapshotStore(reader, checkpoint_dir=tmp_path, run_id="killed").restore()
        assert temporaries(tmp_path) == []  # opening the directory removed the dead writer's file
        assert restored.step >= completed and torch.all(reader.weight == restored.step)
    assert kills == 5 and torn >= 1  # the writers were killed, at least once inside a write
    assert 1 <= len(stored_steps(tmp_path, "killed")) <= 3  # keep=2, plus one written before its prune


# --- a disk that cannot be written, at once or later ----------------------------------------

AS_NOBODY = textwrap.dedent("""
    import json, os, sys, warnings
    import torch, sdc_guard
    from sdc_guard import GemmFault, Policy, SnapshotStore
    root_owned, own = sys.argv[1], sys.argv[2]
    assert os.geteuid() != 0
    results = {}

    def model_and_opt():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def closure_for(model, opt, step):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        def closure():
            opt.zero_grad(); loss = ((model(x) - y) ** 2).mean(); loss.backward(); return loss
        return closure

    model, opt = model_and_opt()
    for name, path in (("existing", root_owned), ("missing", os.path.join(root_owned, "sub"))):
        try:
            SnapshotStore(model, checkpoint_dir=path)
            results[name] = "accepted"
        except ValueError as exc:
            results[name] = str(exc)

    store = SnapshotStore(model, opt, every=1, keep=2, checkpoint_dir=own)
    policy = Policy(on_detection="rollback")
    outcomes = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sdc_guard.drill(model, GemmFault(site="2", phase="forward", step=6)), \\
                sdc_guard.protect(model, snapshots=store, policy=policy) as guard:
            for step in range(8):
                if step == 3:
                    os.chmod(own, 0o555)  # the directory stops being writable mid-run
                outcomes.append(guard.optimizer_step(opt, closure_for(model, opt, step)))
            model(torch.randn(2, 8)).sum().backward()
            after = guard.step()  # the long-lived block still works
    results["warnings"] = [str(w.message) for w in caught if "cannot write checkpoints" in str(w.message)]
    results["stepped"] = [o.stepped for o in outcomes]
    results["rolled_back_to"] = outcomes[6].rolled_back_to
    results["last_good"] = store.last_good.step
    results["disk_error"] = store.disk_error
    results["after_seen"] = after.seen
    results["files"] = sorted(os.listdir(own))
    print("RESULTS " + json.dumps(results), flush=True)

    exit_policy = Policy(on_detection="exit", exit_report_dir=os.path.join(root_owned, "reports"))
    with sdc_guard.drill(model, GemmFault(site="2", phase="forward")), \\
            sdc_guard.protect(model, policy=exit_policy) as guard:
        guard.optimizer_step(opt, closure_for(model, opt, 9))
    print("not reached")
""")


@pytest.mark.slow  # integration-heavy (a subprocess, a CLI run, a training loop): see CONTRIBUTING.md
def test_an_unwritable_directory_as_a_non_root_user(tmp_path: Path) -> None:
    """As uid 65534: a directory it may not write is an error at construction; one that
    becomes unwritable mid-run warns once, keeps snapshots in memory (a rollback after it
    works), never raises nor wedges the block; an exit report it may not write still
    exits with code 16."""
    require_setpriv()
    root_owned = tmp_path / "root_owned"
    own = tmp_path / "own"
    root_owned.mkdir()
    root_owned.chmod(0o555)  # (run as a non-root user already, the suite tests its own files)
    own.mkdir()
    if os.geteuid() == 0:
        os.chown(own, NOBODY, NOBODY)
    proc = run_python(AS_NOBODY, root_owned, own, user=NOBODY, env={"HOME": str(own)})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert lines, proc.stdout + proc.stderr
    results = json.loads(lines[0].removeprefix("RESULTS "))
    for name in ("existing", "missing"):
        assert results[name].startswith("checkpoint_dir: expected a writable directory"), results[name]
        assert "Permission denied" in results[name]
    assert len(results["warnings"]) == 1 and "Permission denied" in results["warnings"][0]
    assert "in memory only" in results["warnings"][0]
    assert results["stepped"] == [True] * 6 + [False, True]
    assert results["rolled_back_to"] == 5 and results["last_good"] == 7
    assert results["after_seen"] > 0 and "EACCES" in results["disk_error"]
    assert [CHECKPOINT_PATTERN.match(f)["step"] for f in results["files"]] == ["1", "2"]  # before the chmod
    assert proc.returncode == sdc_guard.EXIT_TRANSIENT, proc.stdout + proc.stderr
    assert "not reached" not in proc.stdout and "could not write the exit report" in proc.stderr


FULL_DISK = textwrap.dedent("""
    import errno, io, json, os, resource, signal, sys, warnings
    import torch, sdc_guard
    from sdc_guard import SnapshotStore
    directory = sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    first = io.BytesIO()
    torch.save({"step": -1, "model": model.state_dict(), "optimizer": opt.state_dict()}, first)
    # room for the initial checkpoint, not for one with Adam's two moments (+2x the weights)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # write() then fails with EFBIG
    limit = len(first.getvalue()) + 65536
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    results = {}
    try:
        sdc_guard.save_checkpoint(os.path.join(directory, "big.pt"), {"w": torch.zeros(1 << 20)})
    except OSError as exc:
        results["direct"] = [exc.errno == errno.EFBIG, str(exc)]
    store = SnapshotStore(model, opt, every=1, checkpoint_dir=directory)
    x = torch.randn(8, 64)
    def closure():
        opt.zero_grad(); loss = model(x).pow(2).mean(); loss.backward(); return loss
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sdc_guard.protect(model, snapshots=store) as guard:
            outcomes = [guard.optimizer_step(opt, closure) for _ in range(5)]
            model(x).sum().backward()
            results["after_seen"] = guard.step().seen
    results["warnings"] = [str(w.message) for w in caught if "cannot write checkpoints" in str(w.message)]
    results["stepped"] = [o.stepped for o in outcomes]
    results["last_good"] = store.last_good.step
    results["files"] = sorted(os.listdir(directory))
    results["restorable"] = SnapshotStore(model, checkpoint_dir=directory).restore().step
    print(json.dumps(results))
""")


@pytest.mark.slow  # integration-heavy (a subprocess, a CLI run, a training loop): see CONTRIBUTING.md
def test_a_full_disk_is_named_and_degrades_to_memory_with_one_warning(tmp_path: Path) -> None:
    proc = run_python(FULL_DISK, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    is_efbig, message = results["direct"]
    assert is_efbig and "the disk is full" in message and "unexpected pos" not in message
    assert len(results["warnings"]) == 1 and "the disk is full" in results["warnings"][0]
    assert results["stepped"] == [True] * 5 and results["last_good"] == 4 and results["after_seen"] > 0
    assert [n for n in results["files"] if not CHECKPOINT_PATTERN.match(n)] == []  # no temporaries
    assert [CHECKPOINT_PATTERN.match(n)["step"] for n in results["files"]] == ["-1"]
    assert results["restorable"] == -1


# --- exits ---------------------------------------------------------------------------------

EXIT_SCRIPT = textwrap.dedent("""
    import sys, torch, sdc_guard
    from pathlib import Path
    case, target = sys.argv[1], sys.argv[2]
    policy = sdc_guard.Policy(on_detection="exit", exit_report_dir=target)
    if case == "file":
        Path(target).write_text("a file where the report directory should be")
    elif case == "not_a_path":
        policy.exit_report_dir = 123  # Policy(exit_report_dir=123) raises; assigned later, it must not matter
    model = torch.nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.375)  # every output is 1.5: the top exponent bit makes it NaN
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(2, 4)
    def closure():
        opt.zero_grad(); loss = model(x).sum(); loss.backward(); return loss
    fault = sdc_guard.GemmFault(site="Linear", phase="forward", element=(0, 0), step=0)
    with sdc_guard.drill(model, fault), sdc_guard.protect(model, policy=policy) as guard:
        guard.optimizer_step(opt, closure)
    print("not reached")
""")


@pytest.mark.parametrize("case", ["written", "file", "not_a_path"])
@pytest.mark.slow  # integration-heavy (a subprocess, a CLI run, a training loop): see CONTRIBUTING.md
def test_the_exit_code_survives_any_failure_of_the_exit_report(tmp_path: Path, case: str) -> None:
    target = tmp_path / "reports"
    proc = run_python(EXIT_SCRIPT, case, target)
    assert proc.returncode == sdc_guard.EXIT_TRANSIENT, proc.stdout + proc.stderr
    assert "not reached" not in proc.stdout
    if case == "written":
        report = strict_loads((target / "sdc_guard-exit.json").read_text())
        assert report["exit_code"] == sdc_guard.EXIT_TRANSIENT
        ratio = report["detections"][0]["ratio"]
        assert ratio == "inf", ratio  # D/T of a NaN output: non-finite, written as a string
    else:
        assert "could not write the exit report" in proc.stderr, proc.stderr
        assert not (target / "sdc_guard-exit.json").exists()


def test_exit_reports_are_strict_json(tmp_path: Path) -> None:
    from sdc_guard.respond.policy import StepOutcome, write_exit_report
    from sdc_guard.runtime.report import Detection, StepReport

    detections = [Detection(3, "fc1", "addmm", "forward", [0], [0], ratio, (4, 8, 8), "float32", 0)
                  for ratio in (float("inf"), float("nan"), float("-inf"), 2.5)]
    report = StepReport(step=3, seen=4, verified=4, flagged=4, detections=detections, unverified_ops={},
                        verify_seconds=0.0, step_seconds=1.0, overhead=0.0, worst_ratio=float("inf"))
    path = write_exit_report(tmp_path, 17, StepOutcome(3, None, report, [0], "persistent", "exit", False))
    parsed = strict_loads(path.read_text())
    assert [d["ratio"] for d in parsed["detections"]] == ["inf", "nan", "-inf", 2.5]
    assert [float(d["ratio"]) for d in parsed["detections"]][3] == 2.5
    assert parsed["exit_code"] == 17 and parsed["detections"][0]["shape"] == [4, 8, 8]


# --- warn once, across per-step blocks ------------------------------------------------------


class FailingSink:
    def observe_report(self, report) -> None:
        raise ConnectionError("metrics backend down")

    def observe_outcome(self, outcome) -> None:
        raise ConnectionError("metrics backend down")


@dataclass
class FailingDataclassSink(FailingSink):  # eq=True: not hashable
    calls: list = field(default_factory=list)


@pytest.mark.parametrize("sink_type", [FailingSink, FailingDataclassSink])
def test_a_failing_sink_warns_once_over_the_per_step_pattern(sink_type: type) -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sink, policy = sink_type(), Policy()
    store = SnapshotStore(model, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):  # the documented pattern: a new block each step, the same objects
            with sdc_guard.protect(model, metrics=sink, policy=policy, snapshots=store) as guard:
                assert guard.optimizer_step(opt, closure_for(model, opt, step)).stepped
    messages = [str(w.message) for w in caught if "metrics" in str(w.message)]
    assert len(messages) == 1 and "metrics backend down" in messages[0], messages
    with warnings.catch_warnings(record=True) as caught:  # another sink warns for itself
        warnings.simplefilter("always")
        with sdc_guard.protect(model, metrics=sink_type()) as guard:
            guard.optimizer_step(opt, closure_for(model, opt, 4))
    assert len([w for w in caught if "metrics" in str(w.message)]) == 1


# --- drills that cannot fire ------------------------------------------------------------------


class Wrapped(nn.Module):
    """The layout of a Hugging Face causal LM: everything under ``model.``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(nn.Module() for _ in range(2))
        for layer in self.model.layers:
            layer.mlp = nn.Module()
            layer.mlp.up_proj, layer.mlp.down_proj = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.model.layers:
            x = layer.mlp.down_proj(torch.relu(layer.mlp.up_proj(x)))
        return x


def test_a_drill_whose_site_names_no_module_says_so_when_entered() -> None:
    model = Wrapped()
    with pytest.raises(ValueError, match=r"site: expected a module path of the model \(such as "
                                         r"'model\.layers\.1\.mlp\.down_proj'.*got 'layers\.1\.mlp\.down_proj'"):
        with sdc_guard.drill(model, GemmFault(site="layers.1.mlp.down_proj")):
            pass
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.up_proj'.*got 'model\.layers\.0\.mlp\.upproj'"):
        with sdc_guard.drill(model, GemmFault(site="model.layers.0.mlp.upproj")):
            pass
    with sdc_guard.drill(model, GemmFault(site="model.layers.1.mlp.down_proj", step=0)) as faults:
        model(torch.randn(2, 8)).sum().backward()
    assert [i.site for i in faults.injections] == ["model.layers.1.mlp.down_proj"]


# --- backends and the Lightning callback ------------------------------------------------------


class CudaOnly(sdc_guard.backends.Backend):
    """A backend that is available and serves CUDA tensors only (like Triton's kernel)."""

    name = "cuda_only"

    def rejects(self, req) -> str | None:
        return None if req.device.type == "cuda" else f"tensors are on {req.device.type}, the kernel runs on cuda"


@pytest.fixture
def cuda_only():
    sdc_guard.backends.register(CudaOnly())
    yield CudaOnly.name
    sdc_guard.backends.unregister(CudaOnly.name)


def test_a_backend_that_cannot_serve_the_model_is_an_error_before_training(
        cuda_only: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model()
    with pytest.raises(ValueError, match=r"backend: expected a backend that can verify the model's GEMMs "
                                         r"\(torch\.float32 on cpu\), got 'cuda_only', which cannot: tensors are on cpu"):
        sdc_guard.protect(model, backend=cuda_only)
    monkeypatch.setenv("SDC_GUARD_BACKEND", cuda_only)
    with pytest.raises(ValueError, match=r"SDC_GUARD_BACKEND: expected a backend that can verify"):
        sdc_guard.protect(model)
    monkeypatch.setenv("SDC_GUARD_BACKEND", "torch")
    with sdc_guard.protect(model) as guard:  # a usable forced backend verifies every GEMM
        model(torch.zeros(2, 16, dtype=torch.long)).sum().backward()
    assert guard.last_report.verified == guard.last_report.seen > 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # a Lightning fit: see CONTRIBUTING.md
def test_a_fit_that_fails_at_fit_start_releases_its_metrics_port(cuda_only: str, tmp_path: Path) -> None:
    """The callback accepts an available backend; the model's CPU tensors are found at fit
    start, before any step, and the fit's metrics endpoint is closed on the way out."""
    from lightning.pytorch import Trainer

    from lit_models import LitGPT

    port = free_port()
    callback = sdc_guard.SDCGuard(backend=cuda_only, metrics_port=port)
    module = LitGPT()
    before = weights(module)
    trainer = Trainer(callbacks=[callback], accelerator="cpu", devices=1, max_steps=2, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="backend: expected a backend that can verify the model's GEMMs"):
        trainer.fit(module)
    assert trainer.global_step == 0 and all(torch.equal(a, b) for a, b in zip(weights(module), before))
    with socket.socket() as s:  # the port is free again
        s.bind(("127.0.0.1", port))
