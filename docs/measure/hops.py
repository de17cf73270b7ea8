"""Measurement (not a test): higher-order ops under protect(), a drill, and plain dispatch modes.

docs/DESIGN.md ("Interception coverage") quotes its output. One scenario per fresh process
(dynamo caches compiled code and skip decisions per code object):

  for ctx in none empty passthrough protect drill; do
    for sc in cond+ cond- condfirst+ condfirst- flex flexsm flexfirst flexgrad steps; do
      OMP_NUM_THREADS=1 python docs/measure/hops.py $sc $ctx; done; done

Scenarios: ``cond+`` / ``cond-`` a ``torch.cond`` whose branches call submodules, forward
and backward, true / false branch, an unguarded run first; ``condfirst+`` / ``condfirst-``
the guarded run first; ``flex`` / ``flexsm`` flex attention in a module under ``no_grad``,
without / with a ``score_mod``, unguarded first; ``flexfirst`` guarded first; ``flexgrad``
flex attention with grad enabled; ``steps`` four per-step blocks around the ``cond`` model
and two unguarded calls, then the number of graphs dynamo captured. Contexts: ``none`` (no
mode), ``empty`` (a ``TorchDispatchMode`` that runs every op), ``passthrough`` (one that
supports HOPs and is invisible to dynamo), ``protect``, ``drill`` (a fault that never fires).
"""
import sys
import traceback
import os
import contextlib
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import sdc_guard  # noqa: E402
from sdc_guard.runtime.drills.inject import GemmFault, drill  # noqa: E402


class FlexBlock(nn.Module):
    def __init__(self, d=16, h=2):
        super().__init__()
        self.h, self.qkv, self.proj = h, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x, score_mod=None):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        y = flex_attention(q.contiguous(), k.contiguous(), v.contiguous(), score_mod=score_mod)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: self.a(x), lambda x: self.b(self.a(x)), (x,))


class Empty(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class PassThrough(TorchDispatchMode):
    """Control: HOPs passed on, invisible to dynamo, no module hooks."""
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls):
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def context(model):
    ctx = sys.argv[2]
    if ctx == "none":
        return contextlib.nullcontext()
    if ctx == "empty":
        return Empty()
    if ctx == "passthrough":
        return PassThrough()
    if ctx == "protect":
        return sdc_guard.protect(model)
    if ctx == "drill":
        return drill(model, GemmFault(step=10**6))
    raise SystemExit(f"context: expected none, empty, passthrough, protect or drill, got {ctx!r}")


def grads(model, x):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def cond(sign, guarded_first):
    torch.manual_seed(0)
    model = Branchy()

    def run(guarded):
        model.zero_grad(set_to_none=True)
        x = (sign * torch.ones(4, 8)).requires_grad_()
        with context(model) if guarded else contextlib.nullcontext():
            out = model(x)
            out.sum().backward()
        return out.detach(), grads(model, x)

    first, second = run(guarded_first), run(not guarded_first)
    (out, g), (ref, g_ref) = (first, second) if guarded_first else (second, first)
    same = all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
               for a, b in zip(g, g_ref))
    return dict(out_equal=torch.equal(out, ref), grads_equal=same)


def flex(score_mod=None, guarded_first=False, grad=False):
    torch.manual_seed(0)
    model, x = FlexBlock(), torch.randn(2, 8, 16)
    with torch.enable_grad() if grad else torch.no_grad():
        ref = None if guarded_first else model(x, score_mod)
        with context(model):
            out = model(x, score_mod)
        ref = model(x, score_mod) if ref is None else ref
    return dict(out_equal=torch.equal(out, ref))


def steps():
    torch.manual_seed(0)
    model = Branchy()
    for step in range(4):
        x = ((-1.0) ** step * torch.ones(4, 8)).requires_grad_()
        with context(model):
            model(x).sum().backward()
    for _ in range(2):
        model(torch.ones(4, 8, requires_grad=True)).sum().backward()
    return dict(graphs=counters["stats"]["unique_graphs"])


SCENARIOS = {
    "cond+": lambda: cond(1.0, False), "cond-": lambda: cond(-1.0, False),
    "condfirst+": lambda: cond(1.0, True), "condfirst-": lambda: cond(-1.0, True),
    "flex": lambda: flex(), "flexsm": lambda: flex(lambda s, b, h, q, k: s * 0.5),
    "flexfirst": lambda: flex(guarded_first=True), "flexgrad": lambda: flex(grad=True), "steps": steps,
}

if __name__ == "__main__":
    name = f"{sys.argv[1]} {sys.argv[2]}"
    try:
        print(name, "OK", SCENARIOS[sys.argv[1]]())
    except Exception as exc:
        print(name, "RAISE", type(exc).__name__, str(exc).splitlines()[0][:150])
        if os.environ.get("TB"):
            traceback.print_exc()
