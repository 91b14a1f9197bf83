"""Lightning reference on the same work as bare_ddp.py (Lightning is a bench extra only).

    torchrun --standalone --nproc_per_node=2 bench/lightning_ref.py --epochs 4
"""

import json
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.bare_ddp import SimpleNN, parse_args  # noqa: E402
from gpuflow.training.config import TrainConfig  # noqa: E402
from gpuflow.training.data import load_data  # noqa: E402


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = SimpleNN()
        self.loss = nn.CrossEntropyLoss()

    def training_step(self, batch, _):
        x, y = batch
        return self.loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.001)


class Throughput(L.Callback):
    def __init__(self, world):
        self.world, self.seen = world, 0

    def on_train_epoch_start(self, trainer, module):
        self.start, self.seen = time.perf_counter(), 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.seen += len(batch[1])

    def on_train_epoch_end(self, trainer, module):
        if trainer.global_rank == 0:
            rate = self.seen * self.world / (time.perf_counter() - self.start)
            print(json.dumps({"epoch": trainer.current_epoch + 1, "samples_per_s": rate}), flush=True)


def main():
    args = parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    torch.manual_seed(42)
    b = load_data(TrainConfig(dataset=args.dataset, synthetic_size=args.synthetic_size), fingerprint=False)
    loader = DataLoader(TensorDataset(b.train.x, b.train.y), batch_size=args.batch_size // world,
                        shuffle=True)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
                        max_epochs=args.epochs, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Throughput(world)])
    trainer.fit(Module(), loader)


if __name__ == "__main__":
    main()
