"""``sdc-guard bench detect --captured MODELS``: detection by error magnitude on GEMMs
captured from real training, through the public ``verify_matmul``.

For every GEMM captured from a few steps of each model (``sdc_guard.tools.captured``), in
each precision, up to ``--rows`` rows (of any batch element) get one element moved by
``r`` times the RMS of its row segment (256 columns of C), with a random sign; one
``verify_matmul`` call per (GEMM, magnitude, screen) then judges all of them (rows are
independent trials: thresholds and checksums are row-local). A trial is *caught* when
its (row, segment) is confirmed corrupted (the screen flagged it and the exact
confirmation confirmed it: what the guard acts on); a confirmed flag anywhere else is a
false alarm (there must be none). The clean GEMMs are screened too: the share of
segments the screen suspects (each one an exact recomputation) and confirmed false
alarms.

Screens: ``default`` and ``tight`` (the public ones), and, for comparison, the screens
before the threshold read C (``earlier``: bracket at ``e_max`` 1e-3 for bf16 / fp16 and
``u_C |A| @ (|B| r)`` for C's rounding; ``earlier-tight``: ``e_max`` / 4 and 1/32 of that
term), computed by the same backends through ``GemmRequest`` (their bias term is
today's, 19 u_fp32 instead of 2 (u_C + 8 u_fp32): slightly in their favour).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .. import backends
from ..backends import GemmRequest
from ..core.confirm import confirm
from ..core.precision import REDUCED_E_MAX, SEGMENT, UNIT_ROUNDOFF, ScreenTerms, resolve_e_max
from ..core.segments import segment_reduce
from ..verify import verify_matmul
from .bench_common import SHORT_NAME, Outcome, Progress, machine, pct, table
from .captured import CapturedGemm, capture

SCREENS = ("earlier", "earlier-tight", "default", "tight")
PUBLIC = ("default", "tight")
MAGNITUDES = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 10.0)
DEFAULT_MODELS = "hf:llama,hf:gpt2,hf:qwen2moe,hf:t5"
#: precision name -> the dtype its GEMMs run in
DTYPE_OF = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("captured operands (instead of synthetic data)")
    group.add_argument("--captured", default=None, metavar="MODELS",
                       help="measure on GEMMs captured from training these models (bench_models names, comma "
                            f"list, or 'corpus': {DEFAULT_MODELS})")
    group.add_argument("--captured-precisions", default="bf16", help="with --captured: comma list of bf16, fp16, fp32 (default bf16)")
    group.add_argument("--captured-steps", type=int, default=30,
                       help="with --captured: steps trained per model; GEMMs of the second and the last are kept")
    group.add_argument("--captured-rows", type=int, default=32,
                       help="with --captured: corrupted rows per GEMM and magnitude (default 32)")
    group.add_argument("--captured-screens", default=",".join(SCREENS),
                       help="with --captured: comma list of " + ", ".join(SCREENS))


def _names(text: str, known: tuple[str, ...], what: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ValueError(f"{what}: expected a comma list of {', '.join(known)}, got {text!r}")
    return names


def earlier_request(g: CapturedGemm, c: Tensor, screen: str) -> GemmRequest:
    """The request of the screen before C was read (see the module docstring)."""
    dtype = g.a.dtype
    e_max = REDUCED_E_MAX if dtype != torch.float32 else resolve_e_max(None, dtype, torch.device("cpu"))
    share = 1.0 if screen == "earlier" else 1.0 / 32
    if screen == "earlier-tight":
        e_max /= 4
    terms = ScreenTerms(acc=share * UNIT_ROUNDOFF[c.dtype], bounded=0.0)
    return GemmRequest(g.a, g.b, c, e_max, bias=g.bias, alpha=g.alpha, beta=g.beta, rounding=terms)


def judge(g: CapturedGemm, c: Tensor, screen: str) -> tuple[Tensor, Tensor]:
    """(confirmed corruption, screen flags) of ``c`` as the product of ``g``'s operands."""
    if screen in PUBLIC:
        v = verify_matmul(g.a, g.b, c, bias=g.bias, alpha=g.alpha, beta=g.beta, screen=screen)
        assert v.screen_flags is not None
        return v.flags, v.screen_flags
    req = earlier_request(g, c, screen)
    check = backends.select(req).check(req)
    flagged = ~check.ok & ~check.inputs_bad
    if not bool(flagged.any()):
        return torch.zeros_like(flagged), flagged
    return confirm(req, check.ok, check.inputs_bad, check.ratio, on_host=True, limit=None).sdc, flagged


def segment_rms(c: Tensor) -> Tensor:
    """RMS of ``c`` over each row's 256-column segments, ``[..., M, nseg]`` fp32."""
    sq = c.float().square()
    counts = segment_reduce(torch.ones_like(sq[..., :1, :]), lambda t, d: t.sum(d))
    return (segment_reduce(sq, lambda t, d: t.sum(d)) / counts).sqrt()


@dataclass
class Tally:
    trials: int = 0
    caught: int = 0
    false_alarms: int = 0

    def rate(self) -> float:
        return self.caught / self.trials if self.trials else float("nan")


@dataclass
class DtypeResult:
    gemms: int = 0
    by: dict[tuple[str, float], Tally] = field(default_factory=dict)
    segments: int = 0
    suspects: dict[str, int] = field(default_factory=dict)
    confirmed: dict[str, int] = field(default_factory=dict)
    #: D / T of every judged clean segment, per screen (the tail of the statistical terms)
    ratios: dict[str, list[Tensor]] = field(default_factory=dict)


#: quantiles of the clean D / T reported per screen
QUANTILES = (0.5, 0.99, 0.999, 0.9999)


def clean_ratios(g: CapturedGemm, screen: str) -> Tensor:
    """``D / T`` of the clean segments of ``g`` whose inputs are finite (fp32, flat), from
    the request the public call builds (``earlier_request`` for the earlier screens)."""
    from ..verify import make_request

    req = (make_request(g.a, g.b, g.out, bias=g.bias, alpha=g.alpha, beta=g.beta, screen=screen)
           if screen in PUBLIC else earlier_request(g, g.out, screen))
    check = backends.select(req).check(req)
    ratio = check.ratio
    assert ratio is not None
    return ratio[~check.inputs_bad].flatten().float()


def trial(g: CapturedGemm, r: float, screens: list[str], rows: int, gen: torch.Generator,
          result: DtypeResult) -> None:
    """Corrupt up to ``rows`` rows of ``g.out`` by ``r`` segment RMS each and judge them."""
    c = g.out
    flat = c.reshape(-1, c.shape[-1])
    rms = segment_rms(flat)
    live = torch.nonzero(rms.amax(-1) > 0).flatten()
    if live.numel() == 0:
        return
    picked = live[torch.randperm(live.numel(), generator=gen)[:rows]]
    cols = torch.randint(0, c.shape[-1], (picked.numel(),), generator=gen)
    seg_rms = rms[picked, cols // SEGMENT]
    keep = seg_rms > 0
    picked, cols, seg_rms = picked[keep], cols[keep], seg_rms[keep]
    sign = torch.where(torch.rand(picked.shape, generator=gen) < 0.5, -1.0, 1.0)
    bad = flat.clone()
    bad[picked, cols] = (flat[picked, cols].float() + sign * r * seg_rms).to(c.dtype)
    changed = bad[picked, cols] != flat[picked, cols]
    bad = bad.reshape(c.shape)
    for screen in screens:
        sdc, _ = judge(g, bad, screen)
        sdc = sdc.reshape(-1, sdc.shape[-1])
        hit = sdc[picked, cols // SEGMENT] & changed
        tally = result.by.setdefault((screen, r), Tally())
        tally.trials += int(changed.sum())
        tally.caught += int(hit.sum())
        tally.false_alarms += int(sdc.sum()) - int(sdc[picked, cols // SEGMENT].sum())


def _quantiles(parts: list[Tensor]) -> list[float]:
    """``QUANTILES`` and the maximum of the concatenated ``parts`` (nan when empty)."""
    if not parts:
        return [float("nan")] * (len(QUANTILES) + 1)
    x = torch.cat(parts).nan_to_num(nan=float("inf")).double()
    x = x.sort().values
    picks = [float(x[min(x.numel() - 1, int(q * x.numel()))]) for q in QUANTILES]
    return picks + [float(x[-1])]


def run(args: argparse.Namespace, synthetic_magnitudes: tuple[float, ...]) -> Outcome:
    """The captured mode; ``--magnitudes`` left at ``synthetic_magnitudes`` (the synthetic
    mode's default) means this mode's own ``MAGNITUDES``."""
    from .bench_fp import _models  # the corpus's model names

    SYNTHETIC_MAGNITUDES = synthetic_magnitudes

    text = DEFAULT_MODELS if args.captured == "corpus" else args.captured
    models = _models(text)
    precisions = _names(args.captured_precisions, tuple(DTYPE_OF), "captured-precisions")
    screens = _names(args.captured_screens, SCREENS, "captured-screens")
    rows, steps = args.captured_rows, args.captured_steps
    if rows < 1 or steps < 2:
        raise ValueError(f"captured-rows / captured-steps: expected >= 1 / >= 2, got {rows} / {steps}")
    magnitudes = list(args.magnitudes) if args.magnitudes != list(SYNTHETIC_MAGNITUDES) else list(MAGNITUDES)
    progress = Progress(len(models) * len(precisions), quiet=args.quiet)
    results: dict[str, DtypeResult] = {p: DtypeResult() for p in precisions}
    gen = torch.Generator().manual_seed(args.seed)
    started = time.perf_counter()
    for precision in precisions:
        res = results[precision]
        for name in models:
            gemms = capture(name, precision, steps, (1, steps - 1), seed=args.seed)
            for g in gemms:
                res.gemms += 1
                for screen in screens:
                    sdc, flags = judge(g, g.out, screen)
                    res.segments += flags.numel() if screen == screens[0] else 0
                    res.suspects[screen] = res.suspects.get(screen, 0) + int(flags.sum())
                    res.confirmed[screen] = res.confirmed.get(screen, 0) + int(sdc.sum())
                    res.ratios.setdefault(screen, []).append(clean_ratios(g, screen))
                for r in magnitudes:
                    trial(g, r, screens, rows, gen, res)
            progress.step(f"{name} {precision}", f"{len(gemms)} GEMMs")
    lines = []
    for precision, res in results.items():
        body = [[f"{r:g}"] + [f"{pct(res.by[(s, r)].rate())}" if (s, r) in res.by else "-" for s in screens]
                for r in magnitudes]
        lines += [f"{precision} ({SHORT_NAME[DTYPE_OF[precision]]} GEMMs of {', '.join(models)}; {res.gemms} GEMMs): "
                  "share of single-element errors caught and confirmed at their row, by |error| / segment RMS",
                  table(["|err|/rms", *screens], body, align="r" * (len(screens) + 1)), ""]
        for s in screens:
            alarms = res.confirmed.get(s, 0) + sum(t.false_alarms for (sc, _), t in res.by.items() if sc == s)
            rate = res.suspects.get(s, 0) / res.segments if res.segments else 0.0
            qs = _quantiles(res.ratios.get(s, []))
            lines.append(f"  {precision} {s}: clean suspects {res.suspects.get(s, 0)} of {res.segments} segments "
                         f"({rate:.2g} per segment), confirmed false alarms {alarms}; clean D/T "
                         + ", ".join(f"p{100 * q:g} {v:.3g}" for q, v in zip((*QUANTILES, 1.0), qs)))
        lines.append("")
    print("\n".join(lines))
    payload = {"command": "detect", "mode": "captured", "machine": machine(torch.device("cpu")),
               "settings": {"models": models, "precisions": precisions, "screens": screens, "rows": rows,
                            "capture_steps": steps, "magnitudes": magnitudes, "seed": args.seed},
               "results": {p: {"gemms": r.gemms, "segments": r.segments, "suspects": r.suspects,
                               "confirmed": r.confirmed,
                               "clean_ratio_quantiles": {s: dict(zip(("p50", "p99", "p99.9", "p99.99", "max"),
                                                                     _quantiles(r.ratios.get(s, []))))
                                                         for s in screens},
                               "rates": {f"{s} {m:g}": {"trials": t.trials, "caught": t.caught,
                                                        "false_alarms": t.false_alarms}
                                         for (s, m), t in r.by.items()}} for p, r in results.items()},
               "seconds": time.perf_counter() - started}
    alarms = sum(sum(r.confirmed.values()) + sum(t.false_alarms for t in r.by.values()) for r in results.values())
    return Outcome(1 if alarms else 0, payload)
