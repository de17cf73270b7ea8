"""What a step the sampler does not watch costs: an unguarded copy against two guarded ones.

    OMP_NUM_THREADS=1 python docs/measure/unwatched.py [MODEL] [STEPS]

MODEL is a ``sdc_guard.tools.bench_models`` name (default ``hf:llama``), STEPS the
measured steps (default 300). Three identical copies train in turn, step after step (the
order rotated every step, so a slow spell of the machine falls on all three): unguarded;
guarded by a ``protect()`` block per step around forward, backward and ``opt.step()``;
and guarded by a block per step around ``guard.optimizer_step(opt, closure)``. The
sampler, ``EveryN(10**9)``, watches step 0 only: every measured step is one it does not
watch, so what the guarded copies cost beyond the unguarded one is what the guard costs
on such steps. Printed: total time over the unguarded copy's - 1 (mean), and the median
of the per-step ratios. To compare two builds, run it under each
(``PYTHONPATH=/path/to/other/checkout``, from a folder outside both checkouts).
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

import torch

import sdc_guard
from sdc_guard.respond.snapshot import SnapshotStore
from sdc_guard.runtime.sampling import EveryN
from sdc_guard.tools.bench_models import build


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "hf:llama"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    warmup = 5
    work = build(name, seed=0)
    kinds = ["unguarded", "block", "optimizer_step"]
    models = {k: copy.deepcopy(work.model) for k in kinds}
    opts = {k: torch.optim.AdamW(models[k].parameters(), lr=work.lr) for k in kinds}
    guards = {k: sdc_guard.protect(models[k], sampler=EveryN(10**9),
                                   snapshots=SnapshotStore(models[k], opts[k], every=10**9)) for k in kinds[1:]}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(steps + warmup):
        for k in kinds[r % 3:] + kinds[:r % 3]:
            model, opt = models[k], opts[k]

            def closure() -> torch.Tensor:
                opt.zero_grad(set_to_none=True)
                loss = work.loss_of(model, r)
                loss.backward()
                return loss

            started = time.perf_counter()
            if k == "unguarded":
                closure()
                opt.step()
            elif k == "block":
                with guards[k]:
                    closure()
                    opt.step()
            else:
                with guards[k]:
                    guards[k].optimizer_step(opt, closure)
            if r >= warmup:
                times[k].append(time.perf_counter() - started)
    base = times["unguarded"]
    print(f"{name}, {steps} unwatched steps, unguarded step {1e3 * statistics.median(base):.1f} ms (median)")
    for k in kinds[1:]:
        ratios = [t / b for t, b in zip(times[k], base)]
        print(f"  {k:15s} mean {100 * (sum(times[k]) / sum(base) - 1):5.2f} %   "
              f"median {100 * (statistics.median(ratios) - 1):5.2f} %")


if __name__ == "__main__":
    main()
