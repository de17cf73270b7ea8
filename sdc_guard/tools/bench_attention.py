"""``sdc-guard bench overhead --attention``: what verifying fused attention costs against
the bare ``scaled_dot_product_attention``, forward and backward, in one run.

For each cell (context ``L``, head dim, dtype) it times, paired round by round
(``bench_common.time_columns``, medians of per-round ratios after warm-up):

- ``fwd``: the bare SDPA forward; ``screen_fwd``: the forward screen of its output
  (what the guard runs on every call with ``Full()``; the fp64 confirmation runs only on
  a flag, so it is not in the steady-state cost);
- ``bwd``: the bare SDPA backward (autograd of the same call); ``screen_bwd``: the
  backward screen of ``dQ, dK, dV``.

``--path`` picks the screen: ``guard`` (default) what ``protect()`` runs (the native
kernels for CPU tensors when the extension is built, ``runtime.dispatch.attention.screen_forward``),
``native`` (``backends.native_attention``; ``--isa`` forces its AVX-512, AVX2 or plain C
kernels), ``torch`` (``core.attention``, the reference), or ``both`` (native and torch
columns in one run, each paired with the same bare times).

Overhead = screen / bare; the target is <= 50 %. Causal self-attention by default (what
decoder training runs); ``--no-causal`` for full attention.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..backends.native_attention import ISA, attention_isa, native_backward_screen, native_forward_screen
from ..backends.native_attention import rejects as native_rejects
from ..backends.native_attention import unavailable_reason as native_unavailable
from ..core.attention import AttentionOperands, backward_screen, default_scale, forward_screen
from ..runtime.dispatch.attention import screen_backward, screen_forward
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
    group.add_argument("--path", choices=PATHS, default="guard",
                       help="attention: the screen timed: guard (default: what protect() runs), native, torch, "
                            "or both (native and torch columns)")
    group.add_argument("--isa", choices=sorted(ISA), default="auto",
                       help="attention: the native kernels' ISA (default auto: the best this CPU runs, as "
                            "protect() does)")


#: ``--path`` choices
PATHS = ("guard", "native", "torch", "both")


def resolve_paths(path: str, device: torch.device, isa: str = "auto") -> list[str]:
    """The screens ``--path`` times, by name (``native`` / ``torch``); ``ValueError`` naming
    the reason when the native screen is asked for and cannot run."""
    if path == "torch":
        return ["torch"]
    reason = native_unavailable() or (None if device.type == "cpu" else f"the native screen runs on cpu, not {device.type}")
    if reason is None and attention_isa(isa) is None:
        reason = f"--isa {isa}: this CPU does not run those kernels"
    if isa != "auto" and path == "guard":
        raise ValueError("--isa: expected --path native or both (protect() always runs --isa auto)")
    if path == "guard":
        return ["torch" if reason else "native"]
    if reason:
        raise ValueError(f"--path {path}: {reason}")
    return ["native", "torch"] if path == "both" else ["native"]


def _screens(path: str, ops: AttentionOperands, o: torch.Tensor, do: torch.Tensor,
             grads: tuple[torch.Tensor, ...], isa: str) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(forward screen, backward screen) of one path as zero-argument calls."""
    if path == "torch":
        return lambda: forward_screen(ops, o), lambda: backward_screen(ops, do, o, *grads)
    assert native_rejects(ops, o, do, *grads) is None
    return (lambda: native_forward_screen(ops, o, isa=isa),
            lambda: native_backward_screen(ops, do, o, *grads, isa=isa))


def measure(l: int, d: int, dtype: torch.dtype, device: torch.device, args: argparse.Namespace,
            seed: int, paths: list[str]) -> dict[str, Any]:
    """Time the bare SDPA and each path's screens in one cell; returns its JSON row (``ms``
    and ``overhead`` of the first path; ``paths``: every path's)."""
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
        columns: dict[str, Callable[[], Any]] = {
            "fwd": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa),
            "bwd": _with_grad(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)),
        }
        for path in paths:
            columns[f"screen_fwd:{path}"], columns[f"screen_bwd:{path}"] = _screens(path, ops, o, do, (dq, dk, dv),
                                                                                    args.isa)
        # sanity: what the guard runs passes clean data (no false flag)
        assert bool(screen_forward(ops, o).ok.all()), "clean forward flagged"
        assert all(bool(c.ok.all()) for c in (lambda b: (b.dq, b.dk, b.dv))(screen_backward(ops, do, o, dq, dk, dv))), \
            "clean backward flagged"
        times = time_columns(columns, device, reps=args.reps, warmup=args.warmup)
    per_path = {}
    for path in paths:
        sf, sb = times[f"screen_fwd:{path}"], times[f"screen_bwd:{path}"]
        per_path[path] = {"ms": {"screen_fwd": 1e3 * median(sf), "screen_bwd": 1e3 * median(sb)},
                          "overhead": {"fwd": median([s / b for s, b in zip(sf, times["fwd"])]),
                                       "bwd": median([s / b for s, b in zip(sb, times["bwd"])])}}
    first = per_path[paths[0]]
    ms = {"fwd": 1e3 * median(times["fwd"]), "bwd": 1e3 * median(times["bwd"]), **first["ms"]}
    return {"dtype": SHORT_NAME[dtype], "L": l, "head_dim": d, "heads": hq, "kv_heads": hkv,
            "batch": args.batch, "causal": causal, "reps": args.reps, "path": paths[0], "ms": ms,
            "overhead": first["overhead"], "paths": per_path}


def _with_grad(fn: Any) -> Any:
    def run() -> Any:
        with torch.enable_grad():
            return fn()
    return run


def run(args: argparse.Namespace) -> Outcome:
    """All cells, their table, and whether every ratio of the first path met the target."""
    device = resolve_device(args.device)
    paths = resolve_paths(args.path, device, args.isa)
    load_before = load_average()
    rows = []
    for i, (dtype, l, d) in enumerate((t, l, d) for t in args.dtypes for l in args.ctx for d in args.head_dims):
        if not args.quiet:
            print(f"attention L={l} d={d} {SHORT_NAME[dtype]} ...", file=sys.stderr, flush=True)
        rows.append(measure(l, d, dtype, device, args, args.seed + i, paths))
    head = ["dtype", "L", "d", "fwd ms"]
    for phase in ("fwd", "bwd"):
        if phase == "bwd":
            head.append("bwd ms")
        for path in paths:
            head += [f"{path} ms", f"{phase} ovh"]

    def cells(r: dict[str, Any]) -> list[Any]:
        out: list[Any] = [r["dtype"], r["L"], r["head_dim"], f"{r['ms']['fwd']:.2f}"]
        for phase in ("fwd", "bwd"):
            if phase == "bwd":
                out.append(f"{r['ms']['bwd']:.2f}")
            for path in paths:
                p = r["paths"][path]
                out += [f"{p['ms']['screen_' + phase]:.2f}", f"{100 * p['overhead'][phase]:.0f} %"]
        return out

    print(table(head, [cells(r) for r in rows]))
    worst = max(max(r["overhead"].values()) for r in rows)
    met = worst <= TARGET
    isa = f" ({attention_isa(args.isa)} kernels)" if "native" in paths else ""
    print(f"screen: {' and '.join(paths)}{isa}; worst attention overhead ({paths[0]}) {100 * worst:.0f} % "
          f"(target <= {100 * TARGET:.0f} %): {'met' if met else 'NOT met'}")
    payload = {"benchmark": "overhead --attention", "machine": machine(device), "paths": paths,
               "isa": attention_isa(args.isa) if "native" in paths else None, "rows": rows,
               "worst": worst, "target": TARGET, "met": met, "load_before": load_before,
               "load_after": load_average()}
    return Outcome(0, payload)
