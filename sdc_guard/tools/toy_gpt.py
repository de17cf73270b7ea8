"""A small GPT-style character model and a generated corpus, for the demo and examples.

Nothing is downloaded: the corpus is generated from a tiny grammar (deterministic for a
seed), so that ``sdc-guard demo`` runs on a fresh machine with no network and a loss that
visibly falls within a minute on two CPU cores.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import Tensor, nn

_SUBJECTS = ["the engineer", "a silent fault", "the checksum", "every gradient", "the operator",
             "a flipped bit", "the scheduler", "our model", "the weight", "each matmul"]
_VERBS = ["checks", "corrupts", "verifies", "protects", "poisons", "recomputes", "restores", "catches"]
_OBJECTS = ["the loss", "a checkpoint", "the matrix", "every segment", "the threshold", "the node",
            "the optimizer", "a tensor", "the batch", "the run"]
_TAILS = ["", " at once", " before dawn", " in silence", " again", " with care", " every step"]


def make_corpus(n_sentences: int = 4000, seed: int = 0) -> str:
    """Sentences from a tiny grammar: structure to learn, no download.

    >>> make_corpus(2, seed=1).count(".")
    2
    """
    rng = random.Random(seed)
    return " ".join(
        f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_TAILS)}."
        for _ in range(n_sentences)
    )


class CharData:
    """Character-level encoding of a corpus and reproducible batches of windows."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([self.index[c] for c in text], dtype=torch.long)

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def batch(self, step: int, batch: int, ctx: int, seed: int = 0) -> tuple[Tensor, Tensor]:
        """Batch number ``step``: the same windows for the same (step, seed)."""
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.data) - ctx - 1, (batch,), generator=gen)
        x = torch.stack([self.data[s : s + ctx] for s in starts.tolist()])
        y = torch.stack([self.data[s + 1 : s + ctx + 1] for s in starts.tolist()])
        return x, y


@dataclass(frozen=True)
class GPTConfig:
    vocab: int
    ctx: int = 64
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    #: activation checkpointing of every block (non-reentrant ``torch.utils.checkpoint``):
    #: the backward runs each block's forward again
    checkpoint: bool = False


class Attention(nn.Module):
    """Causal self-attention with explicit matmuls, so every GEMM is verifiable
    (fused ``scaled_dot_product_attention`` is not; see the README's limits)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.register_buffer("mask", torch.ones(cfg.ctx, cfg.ctx, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc2 = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a language-model head.

    >>> GPT(GPTConfig(vocab=10, ctx=8, d_model=16, heads=2, layers=1))(torch.zeros(2, 8, dtype=torch.long)).shape
    torch.Size([2, 8, 10])
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Parameter(torch.zeros(cfg.ctx, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            if self.cfg.checkpoint:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln(x))

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(self(x).flatten(0, 1).float(), y.flatten())
