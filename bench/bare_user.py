"""Bare reference for a user's model: the seeds' DDP loop around bench/userproj's Net and
dataset, no gpuflow. Run it as the pipeline launches:

    torchrun --standalone --nproc_per_node=2 bench/bare_user.py --data-root DIR --epochs 3
    python bench/bare_user.py --data-root DIR ...          (one process, no process group)

DistributedSampler + DataLoader (default collate) over the user's map-style dataset, DDP
over gloo, Adam, cross-entropy. Prints one JSON line per epoch with samples/s, as
bench/bare_ddp.py does.
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
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent / "userproj"))
from benchnet.data import datasets  # noqa: E402
from benchnet.nets import Net  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    args = p.parse_args()
    ddp = "RANK" in os.environ
    if ddp:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
    torch.manual_seed(42)
    train, _ = datasets(args.data_root)
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=42)
    loader = DataLoader(train, batch_size=args.batch_size // world, sampler=sampler)
    model = Net(hidden=args.hidden, num_classes=len(train.classes), input_shape=list(train[0][0].shape))
    model = DDP(model) if ddp else model
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        start, seen = time.perf_counter(), 0
        for inputs, labels in loader:
            optimizer.zero_grad()
            loss = criterion(model(inputs), labels)
            loss.backward()
            optimizer.step()
            seen += len(labels)
        elapsed = time.perf_counter() - start
        if rank == 0:
            print(json.dumps({"epoch": epoch + 1, "samples_per_s": seen * world / elapsed,
                              "loss": loss.item()}), flush=True)
    if ddp:
        dist.barrier()  # leave together: a rank tearing gloo down early can abort the other
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
