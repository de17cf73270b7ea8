"""LightningModules the callback tests train: TinyGPT on learnable token sequences."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, Dataset

from models import TinyGPT, lm_batch


class TokenData(Dataset):
    """``n`` deterministic (input, target) sequences."""

    def __init__(self, n: int = 64, ctx: int = 16, vocab: int = 64) -> None:
        self.items = [tuple(t[0] for t in lm_batch(i, batch=1, ctx=ctx, vocab=vocab)) for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.items[i]


class LitGPT(LightningModule):
    def __init__(self, manual: bool = False, lr: float = 1e-2, batch_size: int = 4, **model_kwargs) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyGPT(**({"layers": 1} | model_kwargs))
        self.automatic_optimization = not manual
        self.lr = lr
        self.batch_size = batch_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1).float(), y.flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DataLoader(TokenData(), batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self):
        return DataLoader(TokenData(8), batch_size=self.batch_size)
