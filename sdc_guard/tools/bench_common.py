"""What every ``sdc-guard bench`` subcommand shares: timing, data, products, output.

Timing rules, so that numbers from different columns and machines can be compared:
- every timed call is bracketed by a device synchronisation (CUDA: ``synchronize``), so
  asynchronous launches are not mistaken for finished work;
- columns are timed interleaved (bare, cold, warm, ... in turn, repetition after
  repetition), so that a slow spell of the machine falls on every column alike and the
  ratios of one run stay comparable;
- each column is warmed up first and reported as the median of its repetitions.

A busy machine still moves the numbers: the load average before and after a run is
recorded, and a warning is printed when it says other work competed for the cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor

DTYPE_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}
SHORT_NAME: dict[torch.dtype, str] = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

#: Distributions of the proposal's acceptance 1 (RFC section 3.5.1): what the data looks like.
DISTRIBUTIONS: dict[str, str] = {
    "gaussian": "A, B ~ N(0, 1)",
    "uniform": "A, B ~ U(-1, 1)",
    "scaled": "N(0, 1) times 2^u per row of A and per column of B, u ~ U(-8, 8) (fp16: U(-3, 3), "
              "all its range holds at K = 4096): outlier channels",
}
#: Half-width of the binade range of the scaled distribution, per dtype.
SCALED_BINADES: dict[torch.dtype, float] = {torch.bfloat16: 8.0, torch.float32: 8.0, torch.float16: 3.0}


def argtype(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type=`` that reports ``parse``'s ValueError message as the error."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


def parse_dtypes(text: str) -> list[torch.dtype]:
    """``"bf16,fp32"`` -> ``[torch.bfloat16, torch.float32]`` (argparse type).

    >>> parse_dtypes("bf16,fp32")
    [torch.bfloat16, torch.float32]
    """
    out = []
    for name in filter(None, (t.strip().lower() for t in text.split(","))):
        if name not in DTYPE_NAMES:
            raise ValueError(f"dtypes: expected names from {sorted(set(SHORT_NAME.values()))}, got {name!r}")
        if DTYPE_NAMES[name] not in out:
            out.append(DTYPE_NAMES[name])
    if not out:
        raise ValueError("dtypes: expected at least one dtype, got none")
    return out


def parse_names(text: str, known: Iterable[str], what: str) -> list[str]:
    """Comma-separated names, each one of ``known``.

    >>> parse_names("gaussian,scaled", DISTRIBUTIONS, "dists")
    ['gaussian', 'scaled']
    """
    known = list(known)
    names = [t.strip() for t in text.split(",") if t.strip()]
    for name in names:
        if name not in known:
            raise ValueError(f"{what}: expected names from {known}, got {name!r}")
    if not names:
        raise ValueError(f"{what}: expected at least one name, got none")
    return names


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"512x4096x4096"`` -> ``(512, 4096, 4096)`` (M x K x N).

    >>> parse_shape("8x64x300")
    (8, 64, 300)
    """
    parts = text.lower().replace("*", "x").split("x")
    try:
        m, k, n = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"shape: expected MxKxN with positive ints (e.g. 512x4096x4096), got {text!r}") from None
    if min(m, k, n) < 1:
        raise ValueError(f"shape: expected positive sizes, got {text!r}")
    return m, k, n


def shape_label(m: int, k: int, n: int) -> str:
    return f"{m}x{k}x{n}"


def resolve_device(name: str | None) -> torch.device:
    """``--device`` (default: cuda if available, else cpu), checked to exist."""
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda requested but torch.cuda.is_available() is False")
    torch.empty(1, device=device)  # fail here, with the device's own error, if it is unusable
    return device


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type not in ("cpu", "meta"):
        backend = getattr(torch, device.type, None)
        if backend is not None and hasattr(backend, "synchronize"):
            backend.synchronize()


# --- products and data ---------------------------------------------------------------------

def emulated_fp16(a: Tensor, device: torch.device) -> bool:
    """fp16 GEMMs are emulated on CPU: torch's CPU fp16 matmul is orders of magnitude slower
    than any real fp16 GEMM (15 s for 130 x 4096 x 4096 on the CI machine)."""
    return a.dtype == torch.float16 and device.type == "cpu"


FP16_NOTE = ("fp16 on CPU: the product is computed as a GPU computes it (fp32 accumulation, "
             "rounded to fp16), because torch's CPU fp16 matmul is not a realistic baseline")


def product(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` as the hardware computes it (fp16 on CPU: fp32 GEMM rounded to fp16)."""
    if emulated_fp16(a, a.device):
        return torch.matmul(a.float(), b.float()).half()
    return torch.matmul(a, b)


def operands(dist: str, m: int, k: int, n: int, dtype: torch.dtype, device: torch.device,
             gen: torch.Generator, *, linear: bool = True) -> tuple[Tensor, Tensor]:
    """``A [m, k]`` and ``B [k, n]`` drawn from ``dist``; ``B`` is ``W.t()`` of an
    ``nn.Linear`` weight ``W [n, k]`` when ``linear`` (the layout models run)."""
    shape_b = (n, k) if linear else (k, n)
    if dist == "gaussian":
        a = torch.randn(m, k, generator=gen, device=device)
        w = torch.randn(shape_b, generator=gen, device=device)
    elif dist == "uniform":
        a = torch.rand(m, k, generator=gen, device=device).mul_(2).sub_(1)
        w = torch.rand(shape_b, generator=gen, device=device).mul_(2).sub_(1)
    elif dist == "scaled":
        half = SCALED_BINADES[dtype]
        a = torch.randn(m, k, generator=gen, device=device)
        a *= torch.exp2(torch.rand(m, 1, generator=gen, device=device) * (2 * half) - half)
        w = torch.randn(shape_b, generator=gen, device=device)
        col = torch.exp2(torch.rand(n, generator=gen, device=device) * (2 * half) - half)
        w *= col[:, None] if linear else col[None, :]
    else:
        raise ValueError(f"dist: expected one of {list(DISTRIBUTIONS)}, got {dist!r}")
    a, w = a.to(dtype), w.to(dtype)
    return a, (w.t() if linear else w)


def generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


# --- timing --------------------------------------------------------------------------------

def time_columns(columns: dict[str, Callable[[], Any]], device: torch.device, *, reps: int,
                 warmup: int) -> dict[str, list[float]]:
    """Seconds per call of each column: ``warmup`` untimed calls each, then ``reps`` timed
    rounds in which every column runs once, in an order rotated each round."""
    names = list(columns)
    for _ in range(warmup):
        for name in names:
            columns[name]()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            sync(device)
            start = time.perf_counter()
            columns[name]()
            sync(device)
            times[name].append(time.perf_counter() - start)
    return times


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def spread(values: Sequence[float]) -> float:
    """Relative interquartile range, a noise indicator (0.05 = quartiles 5 % apart)."""
    if len(values) < 4:
        return float("nan")
    q = statistics.quantiles(values, n=4)
    mid = statistics.median(values)
    return (q[2] - q[0]) / mid if mid else float("nan")


def read_bandwidth(device: torch.device, *, reps: int = 15) -> tuple[float, str]:
    """Bytes per second a streaming read achieves on ``device`` (best of ``reps``), and how
    it was measured. A sum over a buffer much larger than the last-level cache."""
    nbytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    x = torch.ones(nbytes // 4, device=device)
    x.sum()
    sync(device)
    best = math.inf
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        x.sum()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best, f"torch.sum over {nbytes >> 20} MiB fp32, best of {reps}"


# --- machine and load ----------------------------------------------------------------------

def machine(device: torch.device) -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {
        "device": str(device), "torch": torch.__version__, "python": platform.python_version(),
        "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
        "cpu": _cpu_name(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    try:
        from .. import __version__
        info["sdc_guard"] = __version__
    except ImportError:  # pragma: no cover
        pass
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def busy_warning(before: float | None, after: float | None, device: torch.device) -> str | None:
    """A warning line when the 1-minute load average says other work shared the CPU."""
    loads = [x for x in (before, after) if x is not None]
    cpus = os.cpu_count() or 1
    # This process itself accounts for up to its thread count while it runs.
    own = min(torch.get_num_threads(), cpus) if device.type == "cpu" else 1
    if loads and max(loads) > own + 0.5:
        return (f"warning: load average {max(loads):.1f} on {cpus} CPUs while measuring: other processes "
                f"competed for the cores, so times are noisy; rerun on an idle machine to confirm")
    return None


# --- progress and output -------------------------------------------------------------------

class Progress:
    """``[i/n] label ... details`` lines on stderr, with elapsed time; silent if ``quiet``.

    ``tick`` reports progress inside a long item, at most every ``every`` seconds.
    """

    def __init__(self, total: int, *, quiet: bool = False, stream: Any = None, every: float = 15.0) -> None:
        self.total, self.quiet, self.done = total, quiet, 0
        self.stream = stream if stream is not None else sys.stderr
        self.started = time.perf_counter()
        self.every = every
        self._last_tick = self.started

    def tick(self, label: str, done: int, of: int) -> None:
        now = time.perf_counter()
        if self.quiet or now - self._last_tick < self.every:
            return
        self._last_tick = now
        print(f"  ... {label}: {done}/{of} ({now - self.started:.0f} s)", file=self.stream, flush=True)

    def step(self, label: str, details: str = "") -> None:
        self.done += 1
        self._last_tick = time.perf_counter()
        if self.quiet:
            return
        elapsed = time.perf_counter() - self.started
        eta = elapsed / self.done * (self.total - self.done)
        tail = f"  {details}" if details else ""
        print(f"[{self.done}/{self.total}] {label}{tail}  ({elapsed:.0f} s, ~{eta:.0f} s left)",
              file=self.stream, flush=True)

    def note(self, text: str) -> None:
        if not self.quiet:
            print(text, file=self.stream, flush=True)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, align: str | None = None) -> str:
    """A plain-text table; numbers right-aligned. ``align``: one ``l``/``r`` per column.

    >>> print(table(["a", "b"], [["x", 1], ["yy", 22]]))
    a    b
    --  --
    x    1
    yy  22
    """
    rows = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    if align is None:
        align = "".join("l" if i == 0 else "r" for i in range(len(headers)))
    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, align)).rstrip()
    lines = [fmt(headers), fmt(["-" * w for w in widths])]
    lines += [fmt(r) for r in rows]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.3g}" if abs(value) < 1e-2 and value != 0 else f"{value:.2f}"
    return str(value)


def pct(value: float) -> str:
    """A fraction as a percentage for tables: 0.123 -> '12.3%'."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{100 * value:.1f}%"


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Write ``payload`` (NaN/inf become null) to ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_clean(payload), f, indent=2)
        f.write("\n")


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, torch.dtype):
        return SHORT_NAME.get(value, str(value))
    return value


@dataclass
class Outcome:
    """What a subcommand hands back to the CLI: its exit status and its JSON payload."""

    status: int
    payload: dict[str, Any] = field(default_factory=dict)


#: (first exponent bit, sign bit) per dtype; mantissa bits lie below the exponent.
BIT_LAYOUT = {torch.float32: (23, 31), torch.float16: (10, 15), torch.bfloat16: (7, 15)}


def bit_field(dtype: torch.dtype, bit: int) -> str:
    """``sign``, ``exponent`` (``exponent (top)`` for the highest) or ``mantissa``.

    >>> bit_field(torch.float32, 30), bit_field(torch.bfloat16, 3)
    ('exponent (top)', 'mantissa')
    """
    first_exp, sign = BIT_LAYOUT[dtype]
    if bit == sign:
        return "sign"
    if bit == sign - 1:
        return "exponent (top)"
    return "exponent" if bit >= first_exp else "mantissa"


# --- corrupting outputs (bench detect) -----------------------------------------------------

INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
#: flip direction -> its label
DIRECTIONS = {"on": "0->1", "off": "1->0"}


def pick_per_row(candidates: Tensor, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """One random True column per row of ``candidates`` (2-D); rows without one are dropped."""
    scores = torch.rand(candidates.shape, generator=gen, device=candidates.device)
    scores = torch.where(candidates, scores, -1.0)
    cols = scores.argmax(-1)
    rows = torch.arange(candidates.shape[0], device=candidates.device)
    keep = candidates[rows, cols]
    return rows[keep], cols[keep]


def bit_set(c: Tensor, bit: int) -> Tensor:
    """Where ``bit`` of each element of ``c`` (bf16, fp16 or fp32) is 1."""
    return ((c.view(INT_VIEW[c.dtype]) >> bit) & 1).bool()


def flip_rows(c: Tensor, rows: Tensor, cols: Tensor, bit: int, width: int) -> Tensor:
    """A copy of 2-D ``c`` with ``bit`` toggled at ``(rows[i], cols[i])``; ``width``: the
    dtype's bits (the top one is the sign of the signed integer view)."""
    bad = c.clone()
    raw = bad.view(INT_VIEW[c.dtype])
    mask = -(1 << bit) if bit == width - 1 else (1 << bit)  # the sign bit of a signed int view
    raw[rows, cols] ^= mask
    return bad
