"""Shared test set-up.

Triton kernels are decorated when ``sdc_guard.kernels.vabft_triton`` is imported, and
the interpreter is chosen at that moment: without a CUDA device the tests run them on CPU
tensors under ``TRITON_INTERPRET=1``, as CI does.
"""

import os
import sys
import zlib
from pathlib import Path

import pytest
import torch

#: tests/support: the shared helpers (models, respond_helpers, fp_models, ...), the worker
#: scripts started as subprocesses and ``paths`` (ROOT, SUPPORT), importable by name from
#: every folder under tests/ (pytest runs with ``--import-mode=importlib``, which puts no
#: test folder on sys.path); spawned workers inherit the path.
SUPPORT = Path(__file__).resolve().parent / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and counters empty before and after the test (the compile tests:
    graph counts and recompilations are asserted, and a cache entry left by one test would
    change what the next one compiles)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _seed_torch(request: pytest.FixtureRequest) -> None:
    """Seed torch's global generator per test, from the test's id: a test draws the same
    data whether it runs alone (``pytest -k``) or in the whole suite, in CI or here, so a
    failure CI saw reproduces. The key is ``tests/<file>::<test>``, the file's name without
    its folder: a test moved between folders of tests/ draws the same data."""
    path, sep, name = request.node.nodeid.partition("::")
    torch.manual_seed(zlib.crc32(f"tests/{path.rpartition('/')[2]}{sep}{name}".encode()))


#: Integration suites every test of which is slow (real Trainer runs, transformers models,
#: compiled attention, several processes, the real-model corpus, the examples): marked
#: ``slow`` here, and not even imported by the fast loop (``-m "not slow"``), whose budget
#: importing Lightning and transformers alone would spend. CONTRIBUTING.md, "test loops".
SLOW_MODULES = frozenset({
    "test_lightning.py", "test_transformers.py", "test_compile_attention.py", "test_fsdp.py",
    "test_fp_corpus.py", "test_examples.py",
})


def _fast_loop(config: pytest.Config) -> bool:
    return config.getoption("markexpr", "").replace(" ", "") == "notslow"


def pytest_ignore_collect(collection_path, config: pytest.Config) -> bool | None:
    if collection_path.name in SLOW_MODULES and _fast_loop(config):
        return True
    return None


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    for item in items:
        # ``corpus``: the long runs (real-model false-positive corpus, long training, most
        # multi-process suites) that the README's command leaves to CI's own named step
        # (``.ci/run``, ``-m corpus``); each is slow too, so the fast loop never runs one
        if item.path.name in SLOW_MODULES or item.get_closest_marker("corpus"):
            item.add_marker(pytest.mark.slow)
