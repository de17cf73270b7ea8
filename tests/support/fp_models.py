"""What the false-positive corpus shares: operands that trip a range- or structure-blind
screen, real models built from small configs, and one guarded training loop that
records what every step saw.

Nothing here is downloaded: the ``transformers`` models are built from configs with
random weights, the text is the package's generated corpus, and the token streams are
generated from a seed.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

import sdc_guard
from sdc_guard.runtime.dispatch.ops import GEMM_HANDLERS
# the corpus's token streams and BERT objective are the ones `sdc-guard bench fp --models` runs
from sdc_guard.tools.bench_models import masked_lm_loss, structured_tokens  # noqa: F401

aten = torch.ops.aten

#: What a clean run is trained in: name -> (autocast dtype or None, GradScaler or not).
PRECISIONS: dict[str, tuple[torch.dtype | None, bool]] = {
    "fp32": (None, False),
    "bf16": (torch.bfloat16, False),
    "fp16": (torch.float16, True),
}


# --- operands ---------------------------------------------------------------------------

def correctly_rounded(a: Tensor, b: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``a @ b`` computed exactly enough (fp64: K products of 8-bit or 24-bit mantissas
    stay far inside 53 bits for the K used here) and rounded once to ``dtype``: the best C
    any hardware could return, so a flag on it is a false alarm by construction."""
    return (a.double() @ b.double()).to(dtype or a.dtype)


def verify_on(backend: str, a: Tensor, b: Tensor, c: Tensor, **kwargs: Any) -> "sdc_guard.Verdict":
    """``verify_matmul`` by ``backend``, with the operands (and a ``bias``) moved to the
    device that backend runs on: the Triton kernel on CUDA, the NPU operator on the NPU,
    the rest on CPU. So a test parametrized over ``backends.available()`` also checks the
    GPU kernel on a machine that has one."""
    device = {"triton": "cuda", "npu": "npu"}.get(backend, "cpu")
    if kwargs.get("bias") is not None:
        kwargs["bias"] = kwargs["bias"].to(device)
    return sdc_guard.verify_matmul(a.to(device), b.to(device), c.to(device), backend=backend, **kwargs)


def causal_attention_t(heads: int, t: int, *, score_scale: float = 0.5,
                       generator: torch.Generator | None = None) -> Tensor:
    """The transposed causal attention matrix ``P^T`` (fp32 ``[heads, t, t]``), as the
    backward's ``dV = P^T @ dO`` reads it: row ``j`` holds ``P[i, j]`` for ``i >= j``,
    so its last rows have 1-4 nonzeros (softmax probabilities) out of ``t``."""
    scores = torch.randn(heads, t, t, generator=generator) * score_scale
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    return scores.masked_fill(~mask, float("-inf")).softmax(-1).transpose(-2, -1).contiguous()


def softmax_grad_rows(v: int, n: int, *, ignore_every: int = 64,
                      generator: torch.Generator | None = None) -> Tensor:
    """``dlogits^T`` (fp32 ``[v, n]``) of a mean cross-entropy over ``n`` tokens and a
    ``v``-word vocabulary, as the LM head's weight gradient reads it: near-constant rows
    (about ``1 / (v n)``), one ``p - 1`` per kept token, and exact zeros in the columns
    of ignored tokens (label -100 every ``ignore_every``)."""
    p = (torch.randn(n, v, generator=generator) * 0.5).softmax(-1)
    labels = torch.randint(0, v, (n,), generator=generator)
    labels[::ignore_every] = -100
    keep = labels >= 0
    g = p.clone()
    g[keep.nonzero().flatten(), labels[keep]] -= 1
    g[~keep] = 0
    g /= keep.sum()
    return g.t().contiguous()


# --- models -----------------------------------------------------------------------------

@dataclass(frozen=True)
class HFSpec:
    """A small ``transformers`` model, built from a config with random init."""

    arch: str  #: "llama", "qwen2", "mistral", "gpt2", "bert", "mixtral", "qwen2moe", "t5", "bart"
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    vocab: int = 1000
    ctx: int = 64
    attn: str = "eager"  #: "eager" (plain bmm, verified) or "sdpa" (fused, counted unverified)


def build_hf(spec: HFSpec, seed: int = 0) -> nn.Module:
    """The model of ``spec`` with weights drawn from ``seed``."""
    import transformers as tf

    torch.manual_seed(seed)
    common: dict[str, Any] = dict(vocab_size=spec.vocab, attn_implementation=spec.attn)
    decoder = dict(hidden_size=spec.hidden, intermediate_size=2 * spec.hidden, num_hidden_layers=spec.layers,
                   num_attention_heads=spec.heads, max_position_embeddings=spec.ctx, **common)
    if spec.arch == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(num_key_value_heads=spec.heads, **decoder))
    if spec.arch == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(num_key_value_heads=max(1, spec.heads // 2), **decoder))
    if spec.arch == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(num_key_value_heads=max(1, spec.heads // 2),
                                                      sliding_window=None, **decoder))
    if spec.arch == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=spec.hidden, n_layer=spec.layers, n_head=spec.heads,
                                                n_positions=spec.ctx, bos_token_id=0, eos_token_id=0, **common))
    if spec.arch == "bert":
        return tf.BertForMaskedLM(tf.BertConfig(hidden_size=spec.hidden, num_hidden_layers=spec.layers,
                                                num_attention_heads=spec.heads, intermediate_size=4 * spec.hidden,
                                                max_position_embeddings=spec.ctx, **common))
    if spec.arch == "mixtral":  # eager experts: plain GEMMs (torch._grouped_mm is counted unverified)
        return tf.MixtralForCausalLM(tf.MixtralConfig(num_key_value_heads=max(1, spec.heads // 2), num_local_experts=4,
                                                      num_experts_per_tok=2, experts_implementation="eager", **decoder))
    if spec.arch == "t5":  # relative position bias: no position in K and V, repeated tokens repeat their rows
        return tf.T5ForConditionalGeneration(tf.T5Config(d_model=spec.hidden, d_kv=spec.hidden // spec.heads,
                                                         d_ff=2 * spec.hidden, num_layers=spec.layers,
                                                         num_heads=spec.heads, decoder_start_token_id=0,
                                                         pad_token_id=0, **common))
    raise ValueError(f"arch: expected llama, qwen2, mistral, gpt2, bert, mixtral or t5, got {spec.arch!r}")


def char_tokens(data: "sdc_guard.tools.toy_gpt.CharData", step: int, batch: int, ctx: int) -> Tensor:
    """``[batch, ctx + 1]`` windows of the package's character corpus."""
    x, y = data.batch(step, batch, ctx)
    return torch.cat([x, y[:, -1:]], dim=1)


def seq2seq_loss(model: nn.Module, seq: Tensor) -> Tensor:
    """An encoder-decoder's own loss on ``seq`` in and ``seq`` one step ahead out."""
    return model(input_ids=seq[:, :-1].contiguous(), labels=seq[:, 1:].contiguous()).loss.float()


def causal_lm_loss(model: nn.Module, seq: Tensor) -> Tensor:
    """Next-token cross-entropy of a causal LM (``transformers`` or the toy GPT) on ``seq``."""
    x, y = seq[:, :-1], seq[:, 1:]
    out = model(x)
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


# --- the guarded loop -------------------------------------------------------------------

@dataclass
class RunRecord:
    """What a guarded run saw, step by step; ``line()`` is what the corpus prints."""

    name: str
    steps: int = 0
    flagged_steps: list[int] = field(default_factory=list)  #: steps with a (confirmed) detection
    first_detection: str = ""  #: step, site, phase, op, D/T of the first one
    responded: list[tuple[int, str | None, str | None]] = field(default_factory=list)  #: (step, class, action)
    reruns: int = 0
    gemms_verified: int = 0
    overflow: int = 0  #: GEMMs with a legitimate overflow (fp16 under a GradScaler), summed over steps
    unverifiable: int = 0  #: GEMMs with non-finite inputs, summed over steps
    unverified_ops: dict[str, int] = field(default_factory=dict)
    worst_ratio: float = 0.0
    #: per-step screen misses and segments screened (None where the report has no such field)
    screen_misses: list[int | None] = field(default_factory=list)
    segments: list[int | None] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    exit_code: int | None = None
    grad_scale: float | None = None  #: the GradScaler's scale at the end (fp16 runs)

    def note(self, outcome: "sdc_guard.StepOutcome") -> None:
        r = outcome.report
        self.steps += 1
        self.gemms_verified += r.verified
        self.overflow += r.overflow
        self.unverifiable += r.unverifiable
        for op, n in r.unverified_ops.items():
            self.unverified_ops[op] = self.unverified_ops.get(op, 0) + n
        if r.worst_ratio == r.worst_ratio:
            self.worst_ratio = max(self.worst_ratio, r.worst_ratio)
        self.screen_misses.append(getattr(r, "screen_misses", None))
        self.segments.append(getattr(r, "segments", None))
        self.reruns += len(outcome.reruns)
        if outcome.loss is not None:
            self.losses.append(float(outcome.loss))
        if r.flagged:
            self.flagged_steps.append(r.step)
            if not self.first_detection:
                d = r.detections[0]
                self.first_detection = (f"step {r.step}: {d.site} ({d.phase} {d.op}, shape {d.shape}), "
                                        f"D/T {d.ratio:.3g}")
        if outcome.classification is not None or outcome.action is not None or not outcome.stepped:
            self.responded.append((r.step, outcome.classification, outcome.action))

    def loss_drop(self, window: int = 10) -> float:
        """Mean loss of the first ``window`` steps minus that of the last: did it train?"""
        first, last = self.losses[:window], self.losses[-window:]
        return sum(first) / len(first) - sum(last) / len(last)

    @property
    def total_misses(self) -> int | None:
        return None if None in self.screen_misses else sum(self.screen_misses)  # type: ignore[arg-type]

    @property
    def total_segments(self) -> int | None:
        return None if None in self.segments else sum(self.segments)  # type: ignore[arg-type]

    def line(self) -> str:
        loss = f"loss {self.losses[0]:.3f} -> {self.losses[-1]:.3f}" if self.losses else "no loss"
        misses, segs = self.total_misses, self.total_segments
        rate = f"{misses / segs:.2e}" if misses is not None and segs else "n/a"
        return (f"[fp-corpus] {self.name}: {self.steps} steps in {self.seconds:.1f} s, {loss}, "
                f"{self.gemms_verified} GEMMs verified, flagged steps {len(self.flagged_steps)}"
                f"{' (first ' + self.first_detection + ')' if self.first_detection else ''}, "
                f"responses {len(self.responded)}, reruns {self.reruns}, screen misses {misses} "
                f"of {segs} segments (rate {rate}), worst screen D/T {self.worst_ratio:.3g}, "
                f"overflow/unverifiable GEMMs {self.overflow}/{self.unverifiable}, "
                f"{'grad scale %g, ' % self.grad_scale if self.grad_scale is not None else ''}"
                f"unverified ops {self.unverified_ops or '{}'}")

    def failure(self) -> str:
        """Why the run is not clean, for an assertion message ('' if it is)."""
        problems = []
        if self.flagged_steps:
            problems.append(f"{len(self.flagged_steps)} of {self.steps} steps flagged "
                            f"(steps {self.flagged_steps[:8]}...), first at {self.first_detection}")
        if self.responded:
            problems.append(f"responses (step, classification, action) {self.responded[:4]}")
        if self.reruns:
            problems.append(f"{self.reruns} re-executions")
        if self.exit_code is not None:
            problems.append(f"exited with code {self.exit_code}")
        return "; ".join(problems)


def train_guarded(
    name: str,
    model: nn.Module,
    loss_of: Callable[[nn.Module, int], Tensor],
    steps: int,
    *,
    precision: str = "fp32",
    lr: float = 1e-3,
    policy: sdc_guard.Policy | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> RunRecord:
    """Train ``model`` for ``steps`` guarded optimizer steps (AdamW at ``lr`` unless an
    ``optimizer`` is given), in ``precision`` ("fp32", "bf16" autocast, or "fp16"
    autocast with a CPU ``GradScaler``), every GEMM verified; ``loss_of(model, step)`` is
    the step's loss. The default policy only logs: the run goes on whatever the guard
    says, so the record holds every step. A ``SDCExit`` (the default ``Policy()``'s last
    response) ends the run and is recorded, not raised."""
    amp_dtype, scaled = PRECISIONS[precision]
    opt = optimizer if optimizer is not None else torch.optim.AdamW(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu") if scaled else None
    record = RunRecord(name)

    def step_fn() -> None:
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()

    started = time.perf_counter()
    policy = policy if policy is not None else sdc_guard.Policy(on_detection="log")
    with sdc_guard.protect(model, policy=policy) as guard:
        for step in range(steps):
            def closure(step: int = step) -> Tensor:
                opt.zero_grad(set_to_none=True)
                if amp_dtype is None:
                    loss = loss_of(model, step)
                else:
                    with torch.autocast("cpu", dtype=amp_dtype):
                        loss = loss_of(model, step)
                (scaler.scale(loss) if scaler is not None else loss).backward()
                return loss.detach()

            try:
                outcome = guard.optimizer_step(opt, closure, step_fn=step_fn)
            except sdc_guard.SDCExit as exc:
                record.note(exc.outcome)
                record.exit_code = int(exc.code) if exc.code is not None else None
                break
            record.note(outcome)
    record.seconds = time.perf_counter() - started
    record.grad_scale = scaler.get_scale() if scaler is not None else None
    return record


def assert_clean(record: RunRecord) -> None:
    """The corpus's claim about a run: no confirmed detection on any step, so no response,
    no re-execution, no exit; and the screen's accounting is there and consistent."""
    print(record.line())
    assert not record.failure(), f"{record.name}: {record.failure()}"
    assert all(m is not None for m in record.screen_misses + record.segments), (
        f"{record.name}: StepReport has no screen_misses / segments")
    assert all(0 <= m <= s for m, s in zip(record.screen_misses, record.segments)), (  # type: ignore[operator]
        f"{record.name}: screen misses outside 0..segments: {list(zip(record.screen_misses, record.segments))}")
    assert sum(record.segments) > 0, f"{record.name}: no segment screened"  # type: ignore[arg-type]
    assert all(math.isfinite(x) for x in record.losses), f"{record.name}: non-finite loss"


# --- capturing a real run's operands ----------------------------------------------------

@dataclass
class CapturedGemm:
    """One GEMM of a real run, copied as it ran: ``out = beta * bias + alpha * (a @ b)``."""

    op: str
    a: Tensor
    b: Tensor
    out: Tensor
    bias: Tensor | None
    alpha: float
    beta: float


class GemmRecorder(TorchDispatchMode):
    """Copies the operands and the result of every ``mm``/``addmm``/``bmm``/``baddbmm``
    run under it (layouts kept: ``clone`` preserves strides), while ``recording``."""

    def __init__(self) -> None:
        super().__init__()
        self.recording = False
        self.gemms: list[CapturedGemm] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.recording or func not in (aten.mm.default, aten.addmm.default, aten.bmm.default,
                                              aten.baddbmm.default):
            return out
        gemm = GEMM_HANDLERS[func.overloadpacket](args, kwargs, out)  # the guard's own reading of the call
        copy = lambda t: None if t is None else t.detach().clone()  # noqa: E731
        self.gemms.append(CapturedGemm(gemm.op, copy(gemm.a), copy(gemm.b), copy(gemm.out), copy(gemm.bias),
                                       gemm.alpha, gemm.beta))
        return out
