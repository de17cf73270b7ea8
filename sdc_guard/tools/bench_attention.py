"""``sdc-guard bench overhead --attention``: what verifying fused attention costs against
the bare ``scaled_dot_product_attention``, forward and backward, in one run.

For each cell (context ``L``, head dim, dtype) it times, paired round by round
(``bench_common.time_columns``, medians of per-round ratios after warm-up):

- ``fwd``: the bare SDPA forward; ``screen_fwd``: the forward screen of its output
  (``core.attention.forward_screen``, what the guard runs on every call with ``Full()``;
  the fp64 confirmation runs only on a flag, so it is not in the steady-state cost);
- ``bwd``: the bare SDPA backward (autograd of the same call); ``screen_bwd``: the
  backward screen of ``dQ, dK, dV`` (``core.attention.backward_screen``).

Overhead = screen / bare; the target is <= 50 % (issue 22). Causal self-attention by
default (what decoder training runs); ``--no-causal`` for full attention.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import torch.nn.functional as F

from ..core.attention import AttentionOperands, backward_screen, default_scale, forward_screen
from .bench_common import (Outcome, SHORT_NAME, argtype, generator, load_average, machine, median,
                           resolve_device, table, time_columns)

TARGET = 0.50  #: screen time / bare SDPA time, forward and backward each


def _ints(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, received {text!r}") from exc
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, received {text!r}")
    return values


def add_arguments(group: Any) -> None:
    """Options of the attention overhead bench (added to ``bench overhead``)."""
    group.add_argument("--attention", action="store_true",
                       help="measure fused attention (SDPA) verification instead of matmuls")
    group.add_argument("--ctx", default="512,2048", type=argtype(_ints), metavar="L[,L...]",
                       help="attention: context lengths (default 512,2048)")
    group.add_argument("--head-dims", default="64,128", type=argtype(_ints), metavar="D[,D...]",
                       help="attention: head dims (default 64,128)")
    group.add_argument("--heads", type=int, default=8, help="attention: query heads (default 8)")
    group.add_argument("--kv-heads", type=int, default=None, help="attention: key/value heads (GQA; default = --heads)")
    group.add_argument("--batch", type=int, default=1, help="attention: batch (default 1)")
    group.add_argument("--no-causal", action="store_true", help="attention: full (non-causal) attention")


def measure(l: int, d: int, dtype: torch.dtype, device: torch.device, args: argparse.Namespace,
            seed: int) -> dict[str, Any]:
    """Time the four columns of one cell; returns its JSON row."""
    hq, hkv = args.heads, args.kv_heads or args.heads
    if hq % hkv:
        raise ValueError(f"--heads: expected a multiple of --kv-heads ({hkv}), received {hq}")
    gen = generator(device, seed)
    def rand(h: int) -> torch.Tensor:
        return torch.randn(args.batch, h, l, d, generator=gen, device=device).to(dtype)
    q, k, v = rand(hq).requires_grad_(), rand(hkv).requires_grad_(), rand(hkv).requires_grad_()
    causal = not args.no_causal
    gqa = {"enable_gqa": True} if hkv != hq else {}
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)
    do = torch.randn(out.shape, generator=gen, device=device).to(dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    ops = AttentionOperands(q.detach(), k.detach(), v.detach(), None, causal, default_scale(d, None))
    o = out.detach()
    with torch.no_grad():
        columns = {
            "fwd": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa),
            "screen_fwd": lambda: forward_screen(ops, o),
            "bwd": lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
            "screen_bwd": lambda: backward_screen(ops, do, o, dq, dk, dv),
        }
        columns["bwd"] = _with_grad(columns["bwd"])
        assert bool(forward_screen(ops, o).ok.all()), "clean forward flagged"  # sanity: no false flag
        times = time_columns(columns, device, reps=args.reps, warmup=args.warmup)
    ms = {name: 1e3 * median(t) for name, t in times.items()}
    overhead = {
        "fwd": median([s / b for s, b in zip(times["screen_fwd"], times["fwd"])]),
        "bwd": median([s / b for s, b in zip(times["screen_bwd"], times["bwd"])]),
    }
    return {"dtype": SHORT_NAME[dtype], "L": l, "head_dim": d, "heads": hq, "kv_heads": hkv,
            "batch": args.batch, "causal": causal, "reps": args.reps, "ms": ms, "overhead": overhead}


def _with_grad(fn: Any) -> Any:
    def run() -> Any:
        with torch.enable_grad():
            return fn()
    return run


def run(args: argparse.Namespace) -> Outcome:
    """All cells, their table, and whether every ratio met the target."""
    device = resolve_device(args.device)
    load_before = load_average()
    rows = []
    for i, (dtype, l, d) in enumerate((t, l, d) for t in args.dtypes for l in args.ctx for d in args.head_dims):
        if not args.quiet:
            print(f"attention L={l} d={d} {SHORT_NAME[dtype]} ...", file=sys.stderr, flush=True)
        rows.append(measure(l, d, dtype, device, args, args.seed + i))
    print(table(["dtype", "L", "d", "fwd ms", "screen ms", "fwd ovh", "bwd ms", "screen ms", "bwd ovh"],
                [[r["dtype"], r["L"], r["head_dim"], f"{r['ms']['fwd']:.2f}", f"{r['ms']['screen_fwd']:.2f}",
                  f"{100 * r['overhead']['fwd']:.0f} %", f"{r['ms']['bwd']:.2f}", f"{r['ms']['screen_bwd']:.2f}",
                  f"{100 * r['overhead']['bwd']:.0f} %"] for r in rows]))
    worst = max(max(r["overhead"].values()) for r in rows)
    met = worst <= TARGET
    print(f"worst attention overhead {100 * worst:.0f} % (target <= {100 * TARGET:.0f} %): {'met' if met else 'NOT met'}")
    payload = {"benchmark": "overhead --attention", "machine": machine(device), "rows": rows,
               "worst": worst, "target": TARGET, "met": met, "load_before": load_before,
               "load_after": load_average()}
    return Outcome(0, payload)
