"""Operands of fused attention calls for ``sdc-guard bench detect --attention``.

What a check can see depends on the data: a flip is caught when it moves a row's checksum
by more than the row's threshold, and the threshold grows with ``P``'s error (the
magnitude of ``S``) and with ``sum_j P_ij |V_j|``. So detection is measured on three
kinds of calls, each one the CPU flash kernel (``scaled_dot_product_attention`` restricted
to ``SDPBackend.FLASH_ATTENTION``) run forward and backward:

- ``gaussian``: ``Q, K, V, dO ~ N(0, 1)``, full (non-causal) attention: logits of
  standard deviation 1, a flat softmax, the textbook case;
- ``peaked``: causal attention with ``Q`` and ``K`` of trained-model norms (entries of
  standard deviation 2, each row's norm times ``2^u``, ``u ~ U(-1, 1)``: logits of standard
  deviation about 5 at ``scale = 1/sqrt(D)``), so most rows put most of their weight on one
  key (at L = 128, past the first 16 rows of a head, the median row's largest weight is
  0.77); ``V`` with outlier channels (``2^u``, ``u ~ U(-2, 2)`` per channel) and ``dO``
  rows of spread norms;
- ``model``: the calls a ``transformers`` Llama built from a config (random weights,
  RoPE, causal, grouped-query attention) makes on a structured token stream, with the
  ``dO`` its language-model loss sends back (fp16 scaled by ``2^16`` as ``GradScaler``
  starts, so that it does not underflow). Random weights give small ``Q K^T``: this is
  attention at the start of training, nearly uniform.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ..core.attention import AttentionOperands, default_scale

CASES: dict[str, str] = {
    "gaussian": "Q, K, V, dO ~ N(0, 1), full attention",
    "peaked": "causal; Q, K with logits of std ~5 (row norms x 2^U(-1,1)), V with outlier channels",
    "model": "the calls of a transformers Llama from a config (RoPE, causal, GQA) and its loss's dO",
}
#: standard deviation of Q and K entries in ``peaked`` (``scale q.k`` has std ``PEAK_STD^2`` before the row spread)
PEAK_STD = 2.0
#: loss scale of the fp16 ``model`` case (``torch.amp.GradScaler``'s initial scale)
FP16_LOSS_SCALE = 2.0**16
MODEL_LAYERS = 2
MODEL_VOCAB = 256


@dataclass(frozen=True)
class AttentionSample:
    """One SDPA call and what the kernel returned: ``ops`` (its operands), ``grad_out``
    (``dO``), the forward's ``out`` (``O``) and the backward's ``grads`` (``dQ, dK, dV``)."""

    case: str
    ops: AttentionOperands
    grad_out: Tensor
    out: Tensor
    grads: tuple[Tensor, Tensor, Tensor]


def run_kernel(ops: AttentionOperands, grad_out: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """``O`` and ``(dQ, dK, dV)`` of ``ops`` with upstream gradient ``grad_out``, from the
    fused kernel (on the CPU the flash kernel, required: the math fallback decomposes into
    ``bmm`` and is verified as GEMMs, not by this check)."""
    q, k, v = (t.detach().requires_grad_() for t in (ops.q, ops.k, ops.v))
    kwargs: dict[str, Any] = {"attn_mask": ops.mask, "is_causal": ops.causal, "scale": ops.scale}
    if q.shape[1] != k.shape[1]:
        kwargs["enable_gqa"] = True
    with torch.enable_grad():
        if q.device.type == "cpu":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                out = F.scaled_dot_product_attention(q, k, v, **kwargs)
                grads = torch.autograd.grad(out, (q, k, v), grad_out)
        else:
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
            grads = torch.autograd.grad(out, (q, k, v), grad_out)
    return out.detach(), (grads[0], grads[1], grads[2])


def check_shape(args: argparse.Namespace) -> None:
    """The shape options, checked: positive, and query heads a multiple of key/value heads."""
    for name in ("ctx", "head_dim", "heads", "kv_heads", "batch"):
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name.replace('_', '-')}: expected a positive int, got {value!r}")
    if args.heads % args.kv_heads:
        raise ValueError(f"heads: expected a multiple of --kv-heads ({args.kv_heads}), got {args.heads}")


def samples(case: str, n: int, dtype: torch.dtype, device: torch.device, args: argparse.Namespace,
            seed: int) -> list[AttentionSample]:
    """``n`` calls of ``case`` in ``dtype``, drawn from ``seed`` (the same values, rounded
    to each dtype, whatever the dtype: the dtypes are compared on the same data)."""
    if case == "model":
        pairs = _model_calls(n, dtype, device, args, seed)
    elif case in CASES:
        gen = torch.Generator(device=device).manual_seed(seed)
        pairs = [_synthetic(case, dtype, device, args, gen) for _ in range(n)]
    else:
        raise ValueError(f"operands: expected names from {list(CASES)}, got {case!r}")
    out = []
    for ops, grad_out in pairs:
        o, grads = run_kernel(ops, grad_out)
        out.append(AttentionSample(case, ops, grad_out, o, grads))
    return out


def _synthetic(case: str, dtype: torch.dtype, device: torch.device, args: argparse.Namespace,
               gen: torch.Generator) -> tuple[AttentionOperands, Tensor]:
    b, hq, hkv, l, d = args.batch, args.heads, args.kv_heads, args.ctx, args.head_dim

    def randn(*shape: int) -> Tensor:
        return torch.randn(shape, generator=gen, device=device)

    def spread(*shape: int, binades: float) -> Tensor:  # 2^u, u ~ U(-binades, binades)
        return torch.exp2(torch.rand(shape, generator=gen, device=device) * (2 * binades) - binades)

    q, k, v, do = randn(b, hq, l, d), randn(b, hkv, l, d), randn(b, hkv, l, d), randn(b, hq, l, d)
    causal = case == "peaked"
    if causal:
        q = q * PEAK_STD * spread(b, hq, l, 1, binades=1.0)
        k = k * PEAK_STD * spread(b, hkv, l, 1, binades=1.0)
        v = v * spread(b, hkv, 1, d, binades=2.0)
        do = do * spread(b, hq, l, 1, binades=1.0)
    ops = AttentionOperands(q.to(dtype), k.to(dtype), v.to(dtype), None, causal, default_scale(d, None))
    return ops, do.to(dtype)


class _Capture(TorchFunctionMode):
    """Records every ``scaled_dot_product_attention`` call (its operands) and, through a
    hook on its output, the gradient the backward sends to it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, Any]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and len(args) > 3:
            raise ValueError("model: scaled_dot_product_attention called with positional options; not captured")
        out = func(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            mask = kwargs.get("attn_mask")
            record = {"q": q.detach().clone(), "k": k.detach().clone(), "v": v.detach().clone(),
                      "mask": mask.detach() if isinstance(mask, Tensor) else None,
                      "causal": bool(kwargs.get("is_causal", False)), "scale": kwargs.get("scale"),
                      "dropout": kwargs.get("dropout_p", 0.0), "grad": None}
            self.calls.append(record)
            out.register_hook(lambda g, r=record: r.__setitem__("grad", g.detach().clone()))
        return out


def _model_calls(n: int, dtype: torch.dtype, device: torch.device, args: argparse.Namespace,
                 seed: int) -> list[tuple[AttentionOperands, Tensor]]:
    try:
        import transformers as tf
    except ImportError as exc:
        raise ValueError(f"operands: 'model' needs transformers (pip install 'sdc-guard[transformers]'): {exc}") from None
    from .bench_models import structured_tokens

    torch.manual_seed(seed)
    hidden = args.heads * args.head_dim
    config = tf.LlamaConfig(vocab_size=MODEL_VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                            num_hidden_layers=MODEL_LAYERS, num_attention_heads=args.heads,
                            num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                            max_position_embeddings=args.ctx, attn_implementation="sdpa")
    model = tf.LlamaForCausalLM(config).to(device=device, dtype=dtype)
    loss_scale = FP16_LOSS_SCALE if dtype == torch.float16 else 1.0
    out: list[tuple[AttentionOperands, Tensor]] = []
    step = 0
    while len(out) < n:
        tokens = structured_tokens(step, args.batch, args.ctx, MODEL_VOCAB, seed).to(device)
        capture = _Capture()
        with capture:
            logits = model(tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        (loss * loss_scale).backward()
        model.zero_grad(set_to_none=True)
        for r in capture.calls:
            if r["grad"] is None or r["dropout"]:
                raise ValueError("model: an attention call without a gradient or with dropout; not measurable")
            d = r["q"].shape[-1]
            out.append((AttentionOperands(r["q"], r["k"], r["v"], r["mask"], r["causal"], default_scale(d, r["scale"])),
                        r["grad"].to(dtype)))
        step += 1
    return out[:n]
