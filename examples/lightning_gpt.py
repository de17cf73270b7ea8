"""Lightning: one line protects every GEMM of training.

    python examples/lightning_gpt.py --steps 200

Trains a small GPT on a generated corpus with ``Trainer(callbacks=[SDCGuard()])``:
every GEMM verified, forward and backward; detections re-executed, rolled back or
escalated; Prometheus metrics on http://127.0.0.1:9464/metrics while it runs.
"""

import argparse

import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, Dataset

from sdc_guard import SDCGuard
from sdc_guard.toy_gpt import GPT, CharData, GPTConfig, make_corpus


class Windows(Dataset):
    def __init__(self, data: CharData, n: int, ctx: int) -> None:
        self.data, self.n, self.ctx = data, n, ctx

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x, y = self.data.batch(i, 1, self.ctx)
        return x[0], y[0]


class LitGPT(LightningModule):
    def __init__(self, data: CharData, steps: int, ctx: int = 64, batch: int = 16) -> None:
        super().__init__()
        self.data, self.steps, self.ctx, self.batch = data, steps, ctx, batch
        self.model = GPT(GPTConfig(vocab=data.vocab, ctx=ctx))

    def training_step(self, batch, batch_idx):
        loss = self.model.loss(*batch)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self):
        return DataLoader(Windows(self.data, self.steps * self.batch, self.ctx), batch_size=self.batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--metrics-port", type=int, default=9464, help="0 disables the endpoint")
    args = parser.parse_args()
    torch.manual_seed(0)
    module = LitGPT(CharData(make_corpus()), args.steps)
    guard = SDCGuard(metrics_port=args.metrics_port or None)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=args.steps, callbacks=[guard],
                      logger=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(module)
    print(f"GEMMs verified: {guard.totals['gemms_verified']}, detections: {guard.totals['detections']}")


if __name__ == "__main__":
    main()
