"""Shared test set-up.

Triton kernels are decorated when ``sdc_guard.kernels.vabft_triton`` is imported, and
the interpreter is chosen at that moment: without a CUDA device the tests run them on CPU
tensors under ``TRITON_INTERPRET=1``, as CI does.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, torch.get_num_threads()))
