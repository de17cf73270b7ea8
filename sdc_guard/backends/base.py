"""The backend interface: ``Backend`` (what every implementation provides; ``registry``
picks one per call). ``GemmRequest`` (one validated verification call) lives in
``core/request.py``, below the backends and the kernels, which all read it."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.abft import AbftCheck, WeightSide, weight_side
from ..core.precision import ScreenTerms
from ..core.request import GemmRequest
from ..core.summary import clear_summary, summarize

__all__ = ["Backend", "GemmRequest"]


class Backend:
    """A verification implementation. Subclasses override the three methods."""

    name: str = "?"

    def unavailable_reason(self) -> str | None:
        """``None`` if this process can use the backend, else why not (one line)."""
        return None

    def rejects(self, req: GemmRequest) -> str | None:
        """``None`` if the backend's contract covers ``req``, else why not (one line)."""
        return None

    def check(self, req: GemmRequest) -> AbftCheck:
        """Verify ``req``; must not write to any input nor synchronise with the host."""
        raise NotImplementedError

    def encode(self, b: Tensor, checksum_weight: Tensor | None = None) -> WeightSide:
        """The weight-side encoding of ``b`` that ``check`` reads fastest (``req.weight``);
        any backend accepts any backend's encoding. Used by the weight cache on a miss."""
        return weight_side(b, checksum_weight)

    def clear_worst(self, req: GemmRequest) -> float | None:
        """The worst ``D / T`` of ``req`` when the backend knows on the host, cheaply, that
        its check came out clear (every segment passed, everything finite), else ``None``
        (not clear, or not known without building the ``AbftCheck``)."""
        return None

    def clear_gemm(self, a: Tensor, b: Tensor, c: Tensor, e_max: float, *, bias: Tensor | None = None,
                   alpha: float = 1.0, beta: float = 1.0, weight: WeightSide | None = None,
                   rounding: ScreenTerms | None = None) -> float | None:
        """``clear_worst`` of the request these arguments make, without making it: the
        guard's path for every verified GEMM (``runtime/checking/checker.py``), where the request
        object and its checks cost as much as a small check. ``None`` here (the default:
        not known cheaply) sends the guard to ``summarize``; a backend with a cheap
        ``clear_worst`` overrides both with the same answers."""
        return None

    def summarize(self, req: GemmRequest, cached: bool = False) -> tuple[Tensor | None, Tensor | list[float]]:
        """Screen ``req``, confirm its flags and keep what the guard keeps of it
        (``core.summary.summarize``): the confirmed-corruption mask (``None`` when clear) and the
        summary. ``cached``: ``req.weight`` came from the weight cache. A clear check known
        on the host (``clear_worst``) skips building its ``AbftCheck``."""
        worst = self.clear_worst(req)
        if worst is not None:
            return None, clear_summary(worst)
        return summarize(req, self.check(req), cached)
