"""How far the screen's threshold sits from your model's data: D/T per site over a run.

``protect(model, stats=True)`` keeps, for every site (module path, phase, op), the
distribution of each verified GEMM's worst screen ``D / T`` and how often the screen
flagged it, in a fixed-size log-spaced histogram (bounded memory however long the run;
quantiles to about 10 %). The numbers come from the per-GEMM summaries the guard reads
at the end of every step anyway, so collecting them costs no extra synchronisation and
no extra pass over any operand. ``guard.screen_stats.summary()`` reports them; as
Megatron's ``report_stats`` does for its checks, it tells a user how much margin the
default threshold leaves on their own model before they tighten it.

>>> s = ScreenStats()
>>> for r in (0.01, 0.02, 0.5): s.observe(("fc1", "forward", "addmm"), r, False)
>>> row = s.summary()[0]; (row.site, row.calls, row.flagged, round(row.max, 2))
('fc1', 3, 0, 0.5)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SiteKey = tuple[str, str, str]

#: Histogram range of D/T and its resolution: bins of 2^(1/8) (9 %) from 1e-9 to 1e9.
_LOW, _HIGH, _PER_OCTAVE = 1e-9, 1e9, 8
_BINS = int(math.ceil(math.log2(_HIGH / _LOW) * _PER_OCTAVE)) + 2


@dataclass
class SiteStats:
    """D/T statistics of one site: ``p50`` / ``p99`` from the histogram (a bin's upper
    edge), ``max`` exact, ``flag_rate`` the share of its GEMMs the screen flagged."""

    site: str
    phase: str
    op: str
    calls: int
    flagged: int
    p50: float
    p99: float
    max: float

    @property
    def flag_rate(self) -> float:
        return self.flagged / self.calls if self.calls else 0.0

    @property
    def margin(self) -> float:
        """How many times the largest D/T fits under the threshold (inf when D was 0)."""
        return 1.0 / self.max if self.max > 0 else math.inf


@dataclass
class _Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * _BINS)
    calls: int = 0
    flagged: int = 0
    max: float = 0.0

    def add(self, ratio: float, flagged: bool) -> None:
        self.calls += 1
        self.flagged += bool(flagged)
        if ratio != ratio:  # a backend without D (the NPU operator): nothing to bin
            return
        self.max = max(self.max, ratio)
        self.counts[_bin(ratio)] += 1

    def quantile(self, q: float) -> float:
        total = sum(self.counts)
        if total == 0:
            return math.nan
        seen, target = 0, q * total
        for i, n in enumerate(self.counts):
            seen += n
            if seen >= target:
                return min(_edge(i), self.max)
        return self.max


def _bin(ratio: float) -> int:
    if ratio <= _LOW:
        return 0
    if ratio >= _HIGH:
        return _BINS - 1
    return 1 + int(math.log2(ratio / _LOW) * _PER_OCTAVE)


def _edge(i: int) -> float:
    """Upper edge of bin ``i``."""
    if i == 0:
        return _LOW
    return _LOW * 2.0 ** (i / _PER_OCTAVE)


class ScreenStats:
    """Per-site D/T histograms and flag counts (see the module docstring)."""

    def __init__(self) -> None:
        self._sites: dict[SiteKey, _Histogram] = {}

    def observe(self, site: SiteKey, ratio: float, flagged: bool) -> None:
        """One verified GEMM of ``site``: its worst screen D/T, and whether it was flagged."""
        hist = self._sites.get(site)
        if hist is None:
            hist = self._sites[site] = _Histogram()
        hist.add(ratio, flagged)

    def summary(self) -> list[SiteStats]:
        """Every site, the largest D/T first."""
        rows = [SiteStats(site, phase, op, h.calls, h.flagged, h.quantile(0.5), h.quantile(0.99), h.max)
                for (site, phase, op), h in self._sites.items()]
        return sorted(rows, key=lambda r: -r.max)

    def overall(self) -> SiteStats:
        """All sites pooled."""
        pooled = _Histogram()
        for h in self._sites.values():
            pooled.counts = [a + b for a, b in zip(pooled.counts, h.counts)]
            pooled.calls += h.calls
            pooled.flagged += h.flagged
            pooled.max = max(pooled.max, h.max)
        return SiteStats("*", "*", "*", pooled.calls, pooled.flagged, pooled.quantile(0.5), pooled.quantile(0.99),
                         pooled.max)
