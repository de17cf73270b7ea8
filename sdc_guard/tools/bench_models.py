"""Real model code for the benchmarks: ``transformers`` models built from small configs and
the package's toy GPT, with their data, losses and a guarded training loop.

Used by ``sdc-guard bench fp --models`` (the real-model false-positive corpus),
``bench calibrate --model`` (the e_max a real run's GEMMs need) and ``bench train
--models``. Nothing is downloaded: ``transformers`` models are built from configs with
random weights, the text is the package's generated corpus, token streams come from a
seed. ``transformers`` is needed only for the ``hf:`` models.

A model is named ``toy:D/CTX/BATCH/LAYERS/LR`` (the toy GPT, 4 heads, AdamW at ``LR``) or
``hf:ARCH`` (``llama``, ``qwen2``, ``mistral``, ``gpt2``, ``bert``; the mixtures of experts
``mixtral`` and ``qwen2moe``, 4 experts, 2 per token, with eager experts: plain GEMMs
rather than ``torch._grouped_mm``, which is counted unverified; the encoder-decoders
``t5``, relative position bias and no position in K and V, and ``bart``; hidden 128,
2 layers).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..runtime.lifecycle.guard import protect
from ..respond.policy import Policy, SDCExit, StepOutcome
from .toy_gpt import GPT, CharData, GPTConfig, make_corpus

#: autocast dtype and GradScaler per precision name
PRECISIONS: dict[str, tuple[torch.dtype | None, bool]] = {
    "fp32": (None, False),
    "bf16": (torch.bfloat16, False),
    "fp16": (torch.float16, True),
}

#: The toy-GPT configurations where earlier screens raised false alarms:
#: d_model / ctx / batch / layers / lr.
TOY_CONFIGS = ("64/64/8/2/3e-3", "128/64/8/2/2e-3", "128/128/4/2/1e-2", "256/64/4/1/1e-3", "64/32/16/3/3e-2")
HF_ARCHS = ("llama", "qwen2", "mistral", "gpt2", "bert", "mixtral", "qwen2moe", "t5", "bart")
#: architectures trained as sequence-to-sequence models (the loss is the model's own)
SEQ2SEQ = ("t5", "bart")


@dataclass
class Workload:
    """A model, its optimizer's learning rate, and the loss of step ``i``."""

    name: str
    model: nn.Module
    lr: float
    loss_of: Callable[[nn.Module, int], Tensor]


def build(name: str, seed: int = 0, attn: str = "eager") -> Workload:
    """The workload called ``name`` (see the module docstring), weights drawn from ``seed``;
    ``attn`` the ``transformers`` attention implementation ("eager": plain matmuls,
    verified as GEMMs; "sdpa": fused, verified by the attention screen)."""
    kind, _, spec = name.partition(":")
    if kind == "toy":
        return _toy(name, spec, seed)
    if kind == "hf":
        return _hf(name, spec, seed, attn)
    raise ValueError(f"model: expected toy:D/CTX/BATCH/LAYERS/LR or hf:ARCH, got {name!r}")


def _toy(name: str, spec: str, seed: int) -> Workload:
    try:
        d, ctx, batch, layers, lr = spec.split("/")
        d_model, ctx_n, batch_n, layers_n, lr_f = int(d), int(ctx), int(batch), int(layers), float(lr)
    except ValueError:
        raise ValueError(f"model: expected toy:D/CTX/BATCH/LAYERS/LR (e.g. toy:{TOY_CONFIGS[0]}), got {name!r}") from None
    data = CharData(make_corpus())
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab=data.vocab, ctx=ctx_n, d_model=d_model, heads=4, layers=layers_n))

    def loss_of(m: nn.Module, step: int) -> Tensor:
        x, y = data.batch(step, batch_n, ctx_n, seed)
        return F.cross_entropy(m(x).flatten(0, 1).float(), y.flatten())

    return Workload(name, model, lr_f, loss_of)


def _hf(name: str, arch: str, seed: int, attn: str) -> Workload:
    try:
        import transformers as tf
    except ImportError as exc:
        raise ImportError(f"model {name!r} needs transformers: pip install 'sdc-guard[transformers]' ({exc})") from None
    hidden, layers, heads, vocab, ctx, batch = 128, 2, 4, 1000, 64, 8
    torch.manual_seed(seed)
    common: dict[str, Any] = dict(vocab_size=vocab, attn_implementation=attn)
    decoder = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                   num_attention_heads=heads, max_position_embeddings=ctx, **common)
    if arch == "llama":
        model: nn.Module = tf.LlamaForCausalLM(tf.LlamaConfig(num_key_value_heads=heads, **decoder))
    elif arch == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(num_key_value_heads=heads // 2, **decoder))
    elif arch == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(num_key_value_heads=heads // 2, sliding_window=None, **decoder))
    elif arch == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=ctx,
                                                 bos_token_id=0, eos_token_id=0, **common))
    elif arch == "bert":
        model = tf.BertForMaskedLM(tf.BertConfig(hidden_size=hidden, num_hidden_layers=layers,
                                                 num_attention_heads=heads, intermediate_size=4 * hidden,
                                                 max_position_embeddings=ctx, **common))
    elif arch == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(num_key_value_heads=heads // 2, num_local_experts=4,
                                                       num_experts_per_tok=2, experts_implementation="eager",
                                                       **decoder))
    elif arch == "qwen2moe":
        model = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            num_key_value_heads=heads // 2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden,
            shared_expert_intermediate_size=2 * hidden, experts_implementation="eager", **decoder))
    elif arch == "t5":
        model = tf.T5ForConditionalGeneration(tf.T5Config(
            d_model=hidden, d_kv=hidden // heads, d_ff=2 * hidden, num_layers=layers, num_heads=heads,
            decoder_start_token_id=0, pad_token_id=0, **common))
    elif arch == "bart":
        model = tf.BartForConditionalGeneration(tf.BartConfig(
            d_model=hidden, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=heads,
            decoder_attention_heads=heads, encoder_ffn_dim=2 * hidden, decoder_ffn_dim=2 * hidden,
            max_position_embeddings=ctx, **common))
    else:
        raise ValueError(f"model: expected hf:{'|'.join(HF_ARCHS)}, got {name!r}")

    def loss_of(m: nn.Module, step: int) -> Tensor:
        seq = structured_tokens(step, batch, ctx, vocab, seed)
        if arch == "bert":
            return masked_lm_loss(m, seq, step)
        if arch in SEQ2SEQ:  # the source sequence in, the same sequence one step ahead out
            return m(input_ids=seq[:, :-1].contiguous(), labels=seq[:, 1:].contiguous()).loss.float()
        logits = m(seq[:, :-1]).logits
        return F.cross_entropy(logits.float().flatten(0, 1), seq[:, 1:].flatten())

    return Workload(name, model, 1e-3, loss_of)


def structured_tokens(step: int, batch: int, ctx: int, vocab: int, seed: int = 0) -> Tensor:
    """``[batch, ctx + 1]`` tokens over the whole vocabulary with structure to learn:
    ``next = (7 cur + 3) mod vocab``, 10 % replaced at random."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    seq = torch.empty(batch, ctx + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
    for t in range(ctx):
        seq[:, t + 1] = (7 * seq[:, t] + 3) % vocab
    noise = torch.rand(batch, ctx + 1, generator=gen) < 0.1
    seq[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=gen)
    return seq


def masked_lm_loss(model: nn.Module, seq: Tensor, step: int) -> Tensor:
    """BERT's objective: 15 % of positions masked (token 0) and predicted; the rest carry
    label -100, so the head's output gradient has exact zero rows."""
    x = seq[:, :-1].clone()
    gen = torch.Generator().manual_seed(77 + step)
    picked = torch.rand(x.shape, generator=gen) < 0.15
    labels = torch.where(picked, x, torch.full_like(x, -100))
    x[picked] = 0
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


@dataclass
class RunRecord:
    """What a guarded run saw."""

    name: str
    precision: str
    screen: str
    steps: int = 0
    flagged_steps: list[int] = field(default_factory=list)  #: steps with a confirmed detection
    responses: int = 0
    screen_misses: int = 0
    segments: int = 0
    gemms: int = 0
    worst_ratio: float = 0.0
    exit_code: int | None = None
    seconds: float = 0.0
    first_loss: float = math.nan
    last_loss: float = math.nan

    @property
    def miss_rate(self) -> float:
        return self.screen_misses / self.segments if self.segments else 0.0

    def note(self, outcome: StepOutcome) -> None:
        report = outcome.report
        self.steps += 1
        self.gemms += report.verified
        self.screen_misses += report.screen_misses + sum(r.screen_misses for r in outcome.reruns)
        self.segments += report.segments
        if report.worst_ratio == report.worst_ratio:
            self.worst_ratio = max(self.worst_ratio, report.worst_ratio)
        if report.flagged:
            self.flagged_steps.append(report.step)
        if outcome.classification is not None or outcome.action is not None:
            self.responses += 1
        if outcome.loss is not None:
            loss = float(outcome.loss)
            if self.first_loss != self.first_loss:
                self.first_loss = loss
            self.last_loss = loss


def train_guarded(work: Workload, steps: int, *, precision: str = "bf16", screen: str = "default",
                  policy: Policy | None = None, optimizer: str = "adamw") -> RunRecord:
    """Train ``work`` for ``steps`` guarded optimizer steps, every GEMM verified, in
    ``precision`` (fp32, bf16 autocast, fp16 autocast with a CPU GradScaler). The default
    policy only logs, so the record holds every step; an exit is recorded, not raised."""
    amp_dtype, scaled = PRECISIONS[precision]
    model = work.model
    opt = torch.optim.AdamW(model.parameters(), lr=work.lr) if optimizer == "adamw" else \
        torch.optim.SGD(model.parameters(), lr=work.lr, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu") if scaled else None
    record = RunRecord(work.name, precision, screen)

    def step_fn() -> None:
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()

    started = time.perf_counter()
    with protect(model, policy=policy or Policy(on_detection="log"), screen=screen) as guard:
        for step in range(steps):
            def closure(step: int = step) -> Tensor:
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
                    loss = work.loss_of(model, step)
                (scaler.scale(loss) if scaler is not None else loss).backward()
                return loss.detach()

            try:
                record.note(guard.optimizer_step(opt, closure, step_fn=step_fn))
            except SDCExit as exc:
                record.note(exc.outcome)
                record.exit_code = int(exc.code) if isinstance(exc.code, int) else None
                break
    record.seconds = time.perf_counter() - started
    return record
