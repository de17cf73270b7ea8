"""``sdc-guard selftest``: prove the installation works, on every backend this process has.

For each available backend and dtype it verifies a known-good product (must pass) and the
same product with one element corrupted (must be caught, at the right row and segment),
and prints what ran. Exit status 0 only if every check behaved.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from .. import backends
from ..verify import verify_matmul


@dataclass
class SelftestResult:
    """One line of the selftest."""

    backend: str
    dtype: str
    clean_ok: bool
    corruption_caught: bool
    ran: str  #: the backend that really ran (the dispatcher's choice)

    @property
    def passed(self) -> bool:
        return self.clean_ok and self.corruption_caught and self.ran == self.backend


def _device_for(name: str) -> str:
    backend = backends.get(name)
    return getattr(backend, "device_type", "cpu")


def check_backend(name: str, dtype: torch.dtype, seed: int = 0) -> SelftestResult:
    """Verify a clean and a corrupted ``[37, 512] @ [512, 300]`` product on ``name``.

    >>> check_backend("torch", torch.float32).passed
    True
    """
    device = _device_for(name)
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(37, 512, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(512, 300, generator=gen).to(device=device, dtype=dtype)
    c = (a.float() @ b.float()).to(dtype)
    clean = verify_matmul(a, b, c, backend=name)
    bad = c.clone()
    bad[21, 270] = bad[21, 270].float() * 2.0**16 + 1e4
    caught = verify_matmul(a, b, bad, backend=name)
    hit = bool(caught.flags[21, 1]) and int(caught.flags.sum()) == 1
    return SelftestResult(name, str(dtype).removeprefix("torch."), clean.kind == "ok", hit, caught.backend)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options: the selftest is the same everywhere."""
    parser.add_argument("--seed", type=int, default=0, help="seed of the test matrices")


def run(args: argparse.Namespace) -> int:
    """Print backend availability and one line per (backend, dtype) check."""
    print("sdc-guard selftest")
    for name, reason in backends.status().items():
        print(f"  backend {name:<7} {'available' if reason is None else 'unavailable: ' + reason}")
    results = [
        check_backend(name, dtype, args.seed)
        for name in backends.available()
        for dtype in (torch.bfloat16, torch.float16, torch.float32)
        if _accepts(name, dtype)
    ]
    for r in results:
        status = "PASS" if r.passed else "FAIL"
        print(f"  {status} {r.backend:<7} {r.dtype:<9} clean product ok={r.clean_ok}  "
              f"corruption caught={r.corruption_caught}  ran on {r.ran}")
    failed = [r for r in results if not r.passed]
    print(f"selftest: {len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed or not results else 0


def _accepts(name: str, dtype: torch.dtype) -> bool:
    """Whether backend ``name``'s contract covers a plain 2-D ``dtype`` product."""
    device = _device_for(name)
    a, b, c = (torch.zeros(shape, dtype=dtype, device=device) for shape in ((8, 16), (16, 256), (8, 256)))
    return backends.get(name).rejects(backends.GemmRequest(a, b, c, 1e-3)) is None
