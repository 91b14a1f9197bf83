"""Bare CPU reference: the seeds' DDP loop, no gpuflow. Run it the same way as the worker:

    torchrun --standalone --nproc_per_node=2 bench/bare_ddp.py --dataset synthetic --epochs 3
    python bench/bare_ddp.py ...            (one process, no process group)

Same model (SimpleNN by default; `--model cnn|resnet18` builds gpuflow's architecture), same
in-memory data and global batch as gpuflow's worker; data goes through TensorDataset +
DataLoader + DistributedSampler as hand-written scripts do, DDP over gloo. Prints one JSON
line per epoch with samples/s, so the benchmark reads both the same way. `--lr`/`--optimizer`
set the optimizer as gpuflow's (sgd: momentum 0.9); `--val` prints a last JSON line with the
validation accuracy (bench/sweep.py's trials). The GPU reference, with the data held on the
device, is bench/bare_gpu.py.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpuflow.training.config import TrainConfig  # noqa: E402  (data only, to feed identical tensors)
from gpuflow.training.data import load_data  # noqa: E402
from gpuflow.training.builder import make_model  # noqa: E402


class SimpleNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 256)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x):
        return self.fc2(self.relu(self.fc1(x.view(x.size(0), -1))))


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="synthetic")
    p.add_argument("--synthetic-size", type=int, default=4096)
    p.add_argument("--synthetic-side", type=int, default=28)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--model", default="mlp", help="mlp (the seeds' SimpleNN), cnn or resnet18")
    p.add_argument("--lr", type=float, default=0.001)
    p.add_argument("--optimizer", choices=["adam", "sgd"], default="adam", help="sgd: momentum 0.9, as gpuflow's")
    p.add_argument("--val", action="store_true", help="print {\"val_accuracy\": ...} after the last epoch")
    p.add_argument("--val-each-epoch", action="store_true", help="add val_accuracy to every epoch's line (a "
                   "plain Optuna pruner's input)")
    return p.parse_args()


def main():
    args = parse_args()
    ddp, rank, world = start()
    torch.manual_seed(42)
    bundle = load_data(TrainConfig(dataset=args.dataset, synthetic_size=args.synthetic_size,
                                   synthetic_side=args.synthetic_side, model=args.model), fingerprint=False)
    dataset = TensorDataset(bundle.train.x, bundle.train.y)
    model = SimpleNN() if args.model == "mlp" else make_model(args.model, bundle.num_classes,
                                                               tuple(bundle.train.x.shape[1:]))[0]
    train(model, dataset, args.epochs, args.batch_size, ddp, rank, world, args.lr, args.optimizer,
          bundle.val if args.val_each_epoch else None)
    if args.val and rank == 0:
        print(json.dumps({"val_accuracy": accuracy(model, bundle.val)}), flush=True)


def accuracy(model: nn.Module, val) -> float:
    """Share of the held-out split (gpuflow's val_fraction and split_seed) classified right."""
    model.eval()
    with torch.no_grad():
        return (model(val.x).argmax(1) == val.y).float().mean().item()


def start() -> tuple[bool, int, int]:
    """(under torchrun?, rank, world size); joins the gloo group under torchrun."""
    ddp = "RANK" in os.environ
    if ddp:
        dist.init_process_group("gloo")
    return (ddp, dist.get_rank(), dist.get_world_size()) if ddp else (False, 0, 1)


def train(model: nn.Module, dataset, epochs: int, batch_size: int, ddp: bool, rank: int, world: int,
          lr: float = 0.001, optimizer_name: str = "adam", val=None) -> None:
    """The seeds' loop: DistributedSampler + DataLoader, DDP, Adam, cross-entropy; one JSON line
    per epoch on rank 0 (with the held-out accuracy when `val` is given); then leaves the group."""
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=42)
    loader = DataLoader(dataset, batch_size=batch_size // world, sampler=sampler)
    model = DDP(model) if ddp else model
    criterion = nn.CrossEntropyLoss()
    optimizer = (torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9) if optimizer_name == "sgd"
                 else torch.optim.Adam(model.parameters(), lr=lr))
    loop_start = time.perf_counter()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        start_s, seen = time.perf_counter(), 0
        for inputs, labels in loader:
            optimizer.zero_grad()
            loss = criterion(model(inputs), labels)
            loss.backward()
            optimizer.step()
            seen += len(labels)
        elapsed = time.perf_counter() - start_s
        if rank == 0:
            scored = {"val_accuracy": accuracy(model, val)} if val is not None else {}
            model.train()
            print(json.dumps({"epoch": epoch + 1, "samples_per_s": seen * world / elapsed,
                              "loss": loss.item(), **scored}), flush=True)
    if rank == 0:  # the whole loop, evaluation included: bench/checkpoints.py's per-epoch wall
        print(json.dumps({"loop_s": time.perf_counter() - loop_start}), flush=True)
    if ddp:
        dist.barrier()  # leave together: a rank tearing gloo down early can abort (SIGABRT) the other
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
