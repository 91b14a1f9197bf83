"""Bare GPU reference for bench/gpu.py: the loop a careful user writes by hand, no gpuflow.

    python bench/bare_gpu.py --model resnet18 --synthetic-side 128 --batch-size 256 --precision bf16

torchvision's resnet18 (`--model resnet18`; `mlp` and `cnn` build gpuflow's architectures),
Adam, the whole dataset moved to the device once, each epoch's order drawn with
`torch.randperm` on the device and every batch gathered there (no DataLoader, no per-step
host copy), bf16 through one `torch.autocast`. One process, one device. The tensors are
gpuflow's synthetic data (training.data.load_data, used only to produce identical inputs).
Prints one JSON line per epoch with samples/s of the training loop, as the worker's
history reports it. `--device cpu` runs the same loop on the CPU (a smoke test).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpuflow.training.config import TrainConfig  # noqa: E402  (data only, to feed identical tensors)
from gpuflow.training.data import load_data  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--synthetic-size", type=int, default=20000)
    p.add_argument("--synthetic-side", type=int, default=128)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--model", default="resnet18", help="resnet18 (torchvision's), or gpuflow's mlp or cnn")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    return p.parse_args(argv)


def build(name: str, num_classes: int, shape: tuple[int, ...]) -> nn.Module:
    if name == "resnet18":
        from torchvision.models import resnet18

        return resnet18(weights=None, num_classes=num_classes)
    from gpuflow.training.builder import make_model

    return make_model(name, num_classes, shape)[0]


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(42)
    bundle = load_data(TrainConfig(dataset="synthetic", synthetic_size=args.synthetic_size,
                                   synthetic_side=args.synthetic_side, model=args.model), fingerprint=False)
    x, y = bundle.train.x.to(device), bundle.train.y.to(device)  # once: batches never leave the device
    model = build(args.model, bundle.num_classes, tuple(x.shape[1:])).to(device)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    bf16 = args.precision == "bf16"
    n, bs = len(y), args.batch_size
    for epoch in range(args.epochs):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        perm = torch.randperm(n, device=device)
        for i in range(0, n, bs):
            idx = perm[i:i + bs]
            inputs, labels = x[idx], y[idx]
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = criterion(model(inputs), labels)
            loss.backward()
            optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        print(json.dumps({"epoch": epoch + 1, "samples_per_s": n / elapsed, "loss": loss.item()}), flush=True)


if __name__ == "__main__":
    main()
