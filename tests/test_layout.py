"""The package layout (issue 20): the former module paths still import, as the same modules."""

import importlib
import subprocess
import sys

import pytest

import sdc_guard

FORMER = {
    "sdc_guard.guard": "sdc_guard.runtime.guard",
    "sdc_guard.inject": "sdc_guard.runtime.inject",
    "sdc_guard.sampling": "sdc_guard.runtime.sampling",
    "sdc_guard.policy": "sdc_guard.respond.policy",
    "sdc_guard.snapshot": "sdc_guard.respond.snapshot",
    "sdc_guard.legacy": "sdc_guard.core.legacy",
    "sdc_guard.toy_gpt": "sdc_guard.tools.toy_gpt",
}


@pytest.mark.parametrize("old", sorted(FORMER))
def test_former_module_path_is_the_same_module(old: str) -> None:
    assert importlib.import_module(old) is importlib.import_module(FORMER[old])
    assert getattr(sdc_guard, old.rpartition(".")[2]) is importlib.import_module(FORMER[old])


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


def test_former_path_in_a_fresh_process() -> None:
    """``import sdc_guard.sampling`` as the first import of a process (the parent's
    ``__init__`` registers the former paths before the child is looked up)."""
    code = "import sdc_guard.toy_gpt, sdc_guard.sampling as s; print(s.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "sdc_guard.runtime.sampling"
