"""Small real models the tests train: an MLP, a BatchNorm MLP and a GPT-style transformer."""

from __future__ import annotations

import math

import torch
from torch import nn


class MLP(nn.Module):
    """Two linear layers: 2 forward GEMMs, 3 backward (fc1's input needs no grad)."""

    def __init__(self, d_in: int = 16, d_hidden: int = 32, d_out: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Attention(nn.Module):
    """Causal self-attention with explicit matmuls (verifiable bmm, not fused SDPA)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """Token embedding, ``layers`` blocks, LM head. ``ac``: activation checkpointing of
    every block, ``"block"`` (non-reentrant ``torch.utils.checkpoint``) or ``"selective"``
    (the same with a policy, as torchtitan's op-level selective AC: the outputs of the
    attention's batched matmuls saved, the rest recomputed in the backward)."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 2, ctx: int = 16,
                 ac: str | None = None) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(ctx, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.ac = ac

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            if self.ac == "block":
                x = checkpoint(block, x, use_reentrant=False)
            elif self.ac == "selective":
                x = checkpoint(block, x, use_reentrant=False, context_fn=selective_ac)
            else:
                x = block(x)
        return self.head(self.ln(x))


def _save_bmm(ctx, op, *args, **kwargs):  # type: ignore[no-untyped-def]
    from torch.utils.checkpoint import CheckpointPolicy
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.bmm.default else CheckpointPolicy.PREFER_RECOMPUTE


def selective_ac():  # type: ignore[no-untyped-def]
    """The contexts of a selective activation checkpoint that saves ``bmm`` outputs."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    return create_selective_checkpoint_contexts(_save_bmm)


def lm_batch(step: int, batch: int = 4, ctx: int = 16, vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch of learnable token sequences and their next-token targets.

    Tokens follow ``next = (5 * cur + 3) % vocab`` with a little noise, so the loss can
    fall well below ``ln(vocab)`` within a few dozen steps.
    """
    gen = torch.Generator().manual_seed(1000 + step)
    seq = torch.empty(batch, ctx + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
    for t in range(ctx):
        seq[:, t + 1] = (5 * seq[:, t] + 3) % vocab
    noise = torch.rand(batch, ctx + 1, generator=gen) < 0.1
    seq[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=gen)
    return seq[:, :-1], seq[:, 1:]


class BNNet(nn.Module):
    """An MLP with BatchNorm and dropout: buffers and random draws in every step."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def bn_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch for BNNet: 8 rows of 16 features, 4 classes, seeded by the step."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def state_copy(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the model's state dict (parameters and buffers), to compare runs."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
