"""Bare reference for a user's model: the seeds' DDP loop around bench/userproj's Net and
dataset, no gpuflow in the loop. Run it as the pipeline launches:

    torchrun --standalone --nproc_per_node=2 bench/bare_user.py --data-root DIR --epochs 3
    python bench/bare_user.py --data-root DIR ...          (one process, no process group)

The loop is bench/bare_ddp.py's (DistributedSampler + DataLoader with default collate over
the user's map-style dataset, DDP over gloo, Adam, cross-entropy), one JSON line per epoch.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "userproj"))
from bare_ddp import start, train  # noqa: E402  (the same seeds' loop, beside this file)
from benchnet.data import datasets  # noqa: E402
from benchnet.nets import Net  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    args = p.parse_args()
    ddp, rank, world = start()
    torch.manual_seed(42)
    dataset, _ = datasets(args.data_root)
    model = Net(hidden=args.hidden, num_classes=len(dataset.classes), input_shape=list(dataset[0][0].shape))
    train(model, dataset, args.epochs, args.batch_size, ddp, rank, world)


if __name__ == "__main__":
    main()
