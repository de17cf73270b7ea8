"""Shared test set-up.

Triton kernels are decorated when ``sdc_guard.kernels.vabft_triton`` is imported, and
the interpreter is chosen at that moment: without a CUDA device the tests run them on CPU
tensors under ``TRITON_INTERPRET=1``, as CI does.
"""

import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed_torch(request: pytest.FixtureRequest) -> None:
    """Seed torch's global generator per test, from the test's id: a test draws the same
    data whether it runs alone (``pytest -k``) or in the whole suite, in CI or here, so a
    failure CI saw reproduces."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
