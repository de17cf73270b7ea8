"""Every public constructor and entry point rejects a bad argument where it is given:
``TypeError`` / ``ValueError`` naming the argument, what was expected and what was
received. One row per argument and bad value; each row builds the call for real.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import pytest
import torch


import sdc_guard  # noqa: E402
from models import MLP  # noqa: E402
from sdc_guard import GemmFault, Policy, SnapshotStore  # noqa: E402
from sdc_guard.runtime.lifecycle.guard import Guard  # noqa: E402
from sdc_guard.runtime.drills.inject import FaultInjector  # noqa: E402
from sdc_guard.runtime.sampling import Budget, EveryN, Full, Rate, Rotating  # noqa: E402

CUDA = torch.cuda.is_available()


class NotASink:
    def observe_report(self, report: Any) -> None:  # observe_outcome is missing
        pass


class NoState:
    """Enough for protect(), not for Lightning checkpoints: no state_dict."""

    def begin_step(self, step: int) -> None:
        pass

    def should_verify(self, site: Any) -> bool:
        return True

    def end_step(self, costs: Any) -> None:
        pass


def model() -> torch.nn.Module:
    return MLP()


def a_file(tmp: Path) -> str:
    path = tmp / "a_file"
    path.write_text("not a directory")
    return str(path)


def enter(context: Any) -> None:
    with context:
        pass


def sdc_callback(**kwargs: Any) -> Any:
    return sdc_guard.SDCGuard(**kwargs)


#: (id, call(tmp_path), exception, argument named, text of the received value)
CASES: list[tuple[str, Callable[[Path], Any], type, str, str]] = [
    # Policy: every field
    ("policy-on_detection", lambda t: Policy(on_detection="retry"), ValueError, "on_detection", "'retry'"),
    ("policy-on_persistent", lambda t: Policy(on_persistent="recompute"), ValueError, "on_persistent", "'recompute'"),
    ("policy-on_repeated", lambda t: Policy(on_repeated="stop"), ValueError, "on_repeated", "'stop'"),
    ("policy-on_nondeterministic", lambda t: Policy(on_nondeterministic=5), ValueError, "on_nondeterministic", "5"),
    ("policy-reruns", lambda t: Policy(reruns=0), ValueError, "reruns", "0"),
    ("policy-reruns-str", lambda t: Policy(reruns="1"), ValueError, "reruns", "'1'"),
    ("policy-window", lambda t: Policy(window=0), ValueError, "window", "0"),
    ("policy-exit_report_dir-int", lambda t: Policy(exit_report_dir=123), TypeError, "exit_report_dir", "123"),
    ("policy-exit_report_dir-file", lambda t: Policy(exit_report_dir=a_file(t)), ValueError, "exit_report_dir",
     "a_file"),
    ("policy-exit_report_dir-empty", lambda t: Policy(exit_report_dir=""), ValueError, "exit_report_dir",
     "empty string"),
    ("policy-persistent_steps-str", lambda t: Policy(persistent_steps="abc"), TypeError, "persistent_steps",
     "'abc'"),
    ("policy-persistent_steps-item", lambda t: Policy(persistent_steps=[3, "4"]), ValueError, "persistent_steps",
     "'4'"),
    ("policy-persistent_steps-negative", lambda t: Policy(persistent_steps=[-1]), ValueError, "persistent_steps",
     "-1"),
    # protect(): every argument
    ("protect-model", lambda t: sdc_guard.protect("model"), TypeError, "model", "str"),
    ("protect-sampler-str", lambda t: sdc_guard.protect(model(), sampler="Full"), TypeError, "sampler", "'Full'"),
    ("protect-sampler-class", lambda t: sdc_guard.protect(model(), sampler=Full), TypeError, "sampler",
     "the class Full"),
    ("protect-e_max-zero", lambda t: sdc_guard.protect(model(), e_max=0), ValueError, "e_max", "got 0"),
    ("protect-e_max-negative", lambda t: sdc_guard.protect(model(), e_max=-1e-3), ValueError, "e_max", "-0.001"),
    ("protect-e_max-above-fp32", lambda t: sdc_guard.protect(model(), e_max=1e39), ValueError, "e_max", "1e+39"),
    ("protect-e_max-above-limit", lambda t: sdc_guard.protect(model(), e_max=2.0), ValueError, "e_max", "2.0"),
    ("protect-e_max-nan", lambda t: sdc_guard.protect(model(), e_max=math.nan), ValueError, "e_max", "nan"),
    ("protect-e_max-str", lambda t: sdc_guard.protect(model(), e_max="1e-3"), TypeError, "e_max", "'1e-3'"),
    ("protect-backend-unknown", lambda t: sdc_guard.protect(model(), backend="nope"), ValueError, "backend",
     "'nope'"),
    ("protect-backend-type", lambda t: sdc_guard.protect(model(), backend=5), TypeError, "backend", "5"),
    ("protect-policy", lambda t: sdc_guard.protect(model(), policy="exit"), TypeError, "policy", "str"),
    ("protect-snapshots", lambda t: sdc_guard.protect(model(), snapshots={}), TypeError, "snapshots", "dict"),
    ("protect-metrics-object", lambda t: sdc_guard.protect(model(), metrics=NotASink()), TypeError, "metrics",
     "NotASink"),
    ("protect-metrics-str", lambda t: sdc_guard.protect(model(), metrics="prometheus"), TypeError, "metrics",
     "'prometheus'"),
    ("protect-history", lambda t: sdc_guard.protect(model(), history=0), ValueError, "history", "0"),
    ("protect-cache_bytes", lambda t: sdc_guard.protect(model(), cache_bytes=-1), ValueError, "cache_bytes", "-1"),
    ("protect-cache_bytes-float", lambda t: sdc_guard.protect(model(), cache_bytes=1.5), ValueError, "cache_bytes",
     "1.5"),
    ("guard-rank", lambda t: Guard(model(), rank=-1), ValueError, "rank", "-1"),
    ("guard-cache_bytes", lambda t: Guard(model(), cache_bytes="big"), ValueError, "cache_bytes", "'big'"),
    # samplers: every argument
    ("rate-p", lambda t: Rate(1.5), ValueError, "p", "1.5"),
    ("rate-seed", lambda t: Rate(0.5, seed="1"), TypeError, "seed", "'1'"),
    ("everyn-n", lambda t: EveryN(0), ValueError, "n", "0"),
    ("everyn-n-str", lambda t: EveryN("2"), ValueError, "n", "'2'"),
    ("rotating-k", lambda t: Rotating(0), ValueError, "k", "0"),
    ("budget-max_overhead", lambda t: Budget(0), ValueError, "max_overhead", "0"),
    ("budget-max_overhead-inf", lambda t: Budget(math.inf), ValueError, "max_overhead", "inf"),
    ("budget-max_overhead-str", lambda t: Budget("0.05"), ValueError, "max_overhead", "'0.05'"),
    ("budget-window", lambda t: Budget(0.05, window=0), ValueError, "window", "0"),
    ("budget-smoothing-str", lambda t: Budget(0.05, smoothing="0.3"), TypeError, "smoothing", "'0.3'"),
    ("budget-smoothing-zero", lambda t: Budget(0.05, smoothing=0), ValueError, "smoothing", "0"),
    ("budget-smoothing-above-one", lambda t: Budget(0.05, smoothing=1.5), ValueError, "smoothing", "1.5"),
    ("budget-warmup", lambda t: Budget(0.05, warmup=0), ValueError, "warmup", "0"),
    # SnapshotStore: every argument
    ("snapshots-model", lambda t: SnapshotStore(None), TypeError, "model", "None"),
    ("snapshots-optimizer", lambda t: SnapshotStore(model(), "adam"), TypeError, "optimizer", "str"),
    ("snapshots-every", lambda t: SnapshotStore(model(), every=0), ValueError, "every", "0"),
    ("snapshots-keep", lambda t: SnapshotStore(model(), keep=0), ValueError, "keep", "0"),
    ("snapshots-checkpoint_dir-int", lambda t: SnapshotStore(model(), checkpoint_dir=5), TypeError,
     "checkpoint_dir", "5"),
    ("snapshots-checkpoint_dir-file", lambda t: SnapshotStore(model(), checkpoint_dir=a_file(t)), ValueError,
     "checkpoint_dir", "is not a directory"),
    ("snapshots-checkpoint_dir-under-a-file", lambda t: SnapshotStore(model(), checkpoint_dir=a_file(t) + "/sub"),
     ValueError, "checkpoint_dir", "a_file/sub"),
    ("snapshots-extras-list", lambda t: SnapshotStore(model(), extras=[1]), TypeError, "extras", "list"),
    ("snapshots-extras-name", lambda t: SnapshotStore(model(), extras={"model": Rate(0.5)}), ValueError, "extras",
     "'model'"),
    ("snapshots-extras-value", lambda t: SnapshotStore(model(), extras={"x": 5}), TypeError, "extras['x']", "int"),
    ("snapshots-run_id", lambda t: SnapshotStore(model(), run_id="a/b"), ValueError, "run_id", "'a/b'"),
    # GemmFault: every field; the drill
    ("fault-site", lambda t: GemmFault(site=5), TypeError, "site", "5"),
    ("fault-op", lambda t: GemmFault(op="conv"), ValueError, "op", "'conv'"),
    ("fault-op-list", lambda t: GemmFault(op=["mm"]), ValueError, "op", "['mm']"),
    ("fault-phase", lambda t: GemmFault(phase="fwd"), ValueError, "phase", "'fwd'"),
    ("fault-step", lambda t: GemmFault(step=-1), ValueError, "step", "-1"),
    ("fault-step-float", lambda t: GemmFault(step=1.5), ValueError, "step", "1.5"),
    ("fault-call", lambda t: GemmFault(call=-1), ValueError, "call", "-1"),
    ("fault-element", lambda t: GemmFault(element=(1, -1)), ValueError, "element", "(1, -1)"),
    ("fault-element-str", lambda t: GemmFault(element="0"), ValueError, "element", "'0'"),
    ("fault-bit-64", lambda t: GemmFault(bit=64), ValueError, "bit", "64"),
    ("fault-bit-negative", lambda t: GemmFault(bit=-1), ValueError, "bit", "-1"),
    ("fault-direction", lambda t: GemmFault(direction="up"), ValueError, "direction", "'up'"),
    ("fault-sticky", lambda t: GemmFault(sticky="yes"), TypeError, "sticky", "'yes'"),
    ("drill-model", lambda t: sdc_guard.drill("model"), TypeError, "model", "str"),
    ("drill-faults", lambda t: sdc_guard.drill(model(), "fc1"), TypeError, "faults", "str"),
    ("drill-seed", lambda t: FaultInjector(model(), seed="0"), TypeError, "seed", "'0'"),
    ("drill-site", lambda t: enter(sdc_guard.drill(model(), GemmFault(site="fc3"))), ValueError, "site", "'fc3'"),
    # one-matmul entry points share the e_max rule
    ("verify_matmul-e_max", lambda t: sdc_guard.verify_matmul(torch.ones(2, 2), torch.ones(2, 2), torch.ones(2, 2),
                                                              e_max=0), ValueError, "e_max", "got 0"),
    ("set_default_e_max", lambda t: sdc_guard.set_default_e_max(torch.float32, 1e39), ValueError, "e_max", "1e+39"),
    # the Lightning callback: every argument
    ("sdcguard-sampler", lambda t: sdc_callback(sampler="Full"), TypeError, "sampler", "'Full'"),
    ("sdcguard-sampler-stateless", lambda t: sdc_callback(sampler=NoState()), TypeError, "sampler",
     "no state_dict, load_state_dict"),
    ("sdcguard-policy", lambda t: sdc_callback(policy={"on_detection": "exit"}), TypeError, "policy", "dict"),
    ("sdcguard-snapshot_every", lambda t: sdc_callback(snapshot_every=0), ValueError, "snapshot_every", "0"),
    ("sdcguard-checkpoint_dir-int", lambda t: sdc_callback(checkpoint_dir=5), TypeError, "checkpoint_dir", "5"),
    ("sdcguard-checkpoint_dir-file", lambda t: sdc_callback(checkpoint_dir=a_file(t)), ValueError, "checkpoint_dir",
     "is not a directory"),
    ("sdcguard-e_max", lambda t: sdc_callback(e_max=0), ValueError, "e_max", "got 0"),
    ("sdcguard-backend-unknown", lambda t: sdc_callback(backend="nope"), ValueError, "backend", "'nope'"),
    ("sdcguard-verify_validation", lambda t: sdc_callback(verify_validation="yes"), TypeError, "verify_validation",
     "'yes'"),
    ("sdcguard-metrics_port", lambda t: sdc_callback(metrics_port=70000), ValueError, "metrics_port", "70000"),
    ("sdcguard-metrics_address", lambda t: sdc_callback(metrics_address=""), ValueError, "metrics_address", "''"),
    ("sdcguard-pushgateway", lambda t: sdc_callback(pushgateway=123), TypeError, "pushgateway", "123"),
    ("sdcguard-log_every_n_steps", lambda t: sdc_callback(log_every_n_steps=0), ValueError, "log_every_n_steps", "0"),
]
if not CUDA:  # a backend that cannot run here is an error before training, not 0 GEMMs verified
    CASES += [
        ("protect-backend-triton-no-cuda", lambda t: sdc_guard.protect(model(), backend="triton"), ValueError,
         "backend", "no CUDA device"),
        ("sdcguard-backend-triton-no-cuda", lambda t: sdc_callback(backend="triton"), ValueError, "backend",
         "no CUDA device"),
    ]
if "npu" not in sdc_guard.backends.available():
    CASES.append(("protect-backend-npu-absent", lambda t: sdc_guard.protect(model(), backend="npu"), ValueError,
                  "backend", "'npu'"))


def _case(case: tuple) -> Any:
    """The Lightning callback's cases import Lightning (seconds): slow, as its suite is."""
    slow = (pytest.mark.slow,) if case[0].startswith("sdcguard") else ()
    return pytest.param(*case[1:], id=case[0], marks=slow)


@pytest.mark.parametrize("call, exception, argument, received", [_case(c) for c in CASES])
def test_a_bad_argument_is_named_where_it_is_given(tmp_path: Path, call: Callable[[Path], Any], exception: type,
                                                    argument: str, received: str) -> None:
    with pytest.raises(exception) as info:
        call(tmp_path)
    message = str(info.value)
    assert message.startswith(f"{argument}: expected "), message
    assert received in message.split("expected", 1)[1], message


def test_good_arguments_are_accepted(tmp_path: Path) -> None:
    """The boundaries of each rule are accepted (a check that rejects too much fails here)."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    Policy(persistent_steps=(3, 4), exit_report_dir=tmp_path / "new")
    Budget(0.05, smoothing=1, window=1, warmup=1)
    Rate(0.0), Rate(1, seed=3), EveryN(1), Rotating(1)
    GemmFault(site="fc1", op="addmm", phase="backward", step=0, call=0, element=[0, 1], bit=31, sticky=True)
    SnapshotStore(net, opt, every=1, keep=1, checkpoint_dir=tmp_path / "a" / "b", extras={"sampler": Rate(0.5)},
                  run_id="job_42.restart")
    assert (tmp_path / "a" / "b").is_dir()
    with sdc_guard.drill(net, GemmFault(site="MLP"), GemmFault(site="global")):
        pass
    guard = sdc_guard.protect(net, sampler=NoState(), e_max=1.0, backend="torch", cache_bytes=0, history=1)
    with guard:
        net(torch.randn(2, 16)).sum().backward()
    assert guard.last_report.verified == 5


@pytest.mark.slow  # imports Lightning (seconds): see CONTRIBUTING.md
def test_good_callback_arguments_are_accepted(tmp_path: Path) -> None:
    callback = sdc_callback(checkpoint_dir=tmp_path / "c", e_max=1e-3, pushgateway="127.0.0.1:9091",
                            metrics_port=None, log_every_n_steps=7, verify_validation=True)
    assert (tmp_path / "c").is_dir() and callback is not None
