"""Issue 21 s.2 measurement (not a test): higher-order ops under protect(), drill, an empty mode.
Run one scenario per fresh process (dynamo caches skip decisions):
  for ctx in empty passthrough protect drill; do for sc in cond+ cond- condfirst+ condfirst- flex flexsm flexfirst; do
    OMP_NUM_THREADS=1 python docs/measure/hops.py $sc $ctx [--ignore-compile-internals] [--opaque-cond-under-grad]; done; done
"""
import sys, traceback, os, warnings
warnings.filterwarnings("ignore")
import torch
from torch import nn
from torch.nn.attention.flex_attention import flex_attention
from torch.utils._python_dispatch import TorchDispatchMode
import sdc_guard

class FlexBlock(nn.Module):
    def __init__(s, d=16, h=2):
        super().__init__(); s.h=h; s.qkv=nn.Linear(d,3*d); s.proj=nn.Linear(d,d)
    def forward(s, x, score_mod=None):
        b,t,d=x.shape
        q,k,v=s.qkv(x).view(b,t,3,s.h,d//s.h).permute(2,0,3,1,4)
        y=flex_attention(q.contiguous(),k.contiguous(),v.contiguous(), score_mod=score_mod)
        return s.proj(y.transpose(1,2).reshape(b,t,d))

class Branchy(nn.Module):
    def __init__(s):
        super().__init__(); s.a=nn.Linear(8,8); s.b=nn.Linear(8,8)
    def forward(s,x):
        return torch.cond(x.sum()>0, lambda x: s.a(x), lambda x: s.b(s.a(x)), (x,))

class Empty(TorchDispatchMode):
    def __torch_dispatch__(s,f,t,a=(),k=None): return f(*a,**(k or {}))

class PassThrough(TorchDispatchMode):
    """Control: HOPs passed on, invisible to dynamo, no module hooks."""
    supports_higher_order_operators = True
    @classmethod
    def ignore_compile_internals(cls): return True
    def __torch_dispatch__(s,f,t,a=(),k=None): return f(*a,**(k or {}))

def run(name, fn):
    try:
        r = fn(); print(name, "OK", r)
    except Exception as e:
        print(name, "RAISE", type(e).__name__, str(e).splitlines()[0][:150]); import os
        os.environ.get("TB") and traceback.print_exc()

def cond_grad(ctx_factory, sign=1.0):
    torch.manual_seed(0); m=Branchy(); x=(sign*torch.ones(4,8)).requires_grad_()
    ref=m(x); ref.sum().backward(); g_ref=[p.grad.clone() if p.grad is not None else None for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    with ctx_factory(m):
        out=m(x); out.sum().backward()
    g=[p.grad for p in m.parameters()]
    same=all((a is None and b is None) or (a is not None and b is not None and torch.equal(a,b)) for a,b in zip(g_ref,g))
    return dict(out_eq=torch.equal(out,ref), grads_eq=same, none=[a is None for a in g])

def flex(ctx_factory, grad, score_mod=None):
    torch.manual_seed(0); m=FlexBlock(); x=torch.randn(2,8,16)
    c = torch.enable_grad if grad else torch.no_grad
    with c():
        ref=m(x, score_mod)
        with ctx_factory(m):
            out=m(x, score_mod)
            if grad: out.sum().backward()
    return dict(out_eq=torch.equal(out,ref))

from sdc_guard.runtime.inject import GemmFault, drill
sc, ctx = sys.argv[1], sys.argv[2]
from sdc_guard.runtime.ops import RoutingMode
if "--ignore-compile-internals" in sys.argv:
    RoutingMode.ignore_compile_internals = classmethod(lambda cls: True)
if "--opaque-cond-under-grad" in sys.argv:
    _orig = RoutingMode._higher_order
    def _ho(self, func, args, kwargs):
        if func.name() in ("cond", "while_loop") and (torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1):
            self.on_opaque(f"higher_order.{func.name()}")
            return func(*args, **kwargs)
        return _orig(self, func, args, kwargs)
    RoutingMode._higher_order = _ho
cf = {"empty": lambda m: Empty(), "protect": lambda m: sdc_guard.protect(m),
      "drill": lambda m: drill(m, GemmFault(op="nothing_matches"))}[ctx] if False else None
def mk(m):
    if ctx=="empty": return Empty()
    if ctx=="passthrough": return PassThrough()
    if ctx=="protect": return sdc_guard.protect(m)
    if ctx=="drill": return drill(m, GemmFault(step=10**6))
def cond_guard_first(sign):
    torch.manual_seed(0); m=Branchy(); x=(sign*torch.ones(4,8)).requires_grad_()
    with mk(m):
        out=m(x); out.sum().backward()
    g=[None if p.grad is None else p.grad.clone() for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    ref=m(x); ref.sum().backward()
    return dict(out_eq=torch.equal(out,ref), grads_eq=[(a is None and p.grad is None) or (a is not None and p.grad is not None and torch.equal(a,p.grad)) for a,p in zip(g,m.parameters())], none=[a is None for a in g])
S = {
 "cond+": lambda: cond_grad(mk, 1.0), "cond-": lambda: cond_grad(mk, -1.0),
 "condfirst+": lambda: cond_guard_first(1.0), "condfirst-": lambda: cond_guard_first(-1.0),
 "flex": lambda: flex(mk, False), "flexsm": lambda: flex(mk, False, lambda s,b,h,q,k: s*0.5),
 "flexfirst": None,
}
def flexfirst():
    torch.manual_seed(0); m=FlexBlock(); x=torch.randn(2,8,16)
    with torch.no_grad():
        with mk(m): out=m(x)
        ref=m(x)
    return dict(out_eq=torch.equal(out,ref))
S["flexfirst"]=flexfirst
run(f"{sc} {ctx}", S[sc])
