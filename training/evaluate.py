"""Evaluate a checkpoint: `python -m training.evaluate --checkpoint CK [--dataset D ...]`.

Loads only tensors (weights_only=True), rebuilds the plain model from the config stored in
the checkpoint, and reports loss and accuracy on the dataset's validation split (the same
deterministic split training held out) or on all of it. Run it in a child whose
CUDA_VISIBLE_DEVICES holds the card to use: inside, that card is cuda:0.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch import nn

from .checkpoint import CheckpointError, load_file, load_model_state
from .config import TrainConfig
from .data import TensorData, load_data
from .models import build_model


def evaluate(checkpoint: str, split: str = "val", device: str = "auto", batch_size: int = 512,
             **overrides) -> dict:
    payload = load_file(checkpoint)
    if "config" not in payload or "model" not in payload:
        raise CheckpointError(f"checkpoint {checkpoint!r} lacks its config; it was not written by gpuflow")
    cfg = TrainConfig(**{**payload["config"], **{k: v for k, v in overrides.items() if v is not None},
                         "strategy": "single", "device_ids": None, "resume": "never"})
    bundle = load_data(cfg, fingerprint=False)
    use_cuda = device != "cpu" and torch.cuda.is_available()
    dev = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    model = build_model(cfg.model, bundle.num_classes, bundle.input_shape)
    load_model_state(model, payload["model"], source=f"checkpoint {checkpoint!r}")
    model.to(dev).eval()
    data = bundle.val if split == "val" else _concat(bundle.train, bundle.val)
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, pin_memory=use_cuda)
    loss, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(dev), y.to(dev)
            out = model(x)
            loss += nn.functional.cross_entropy(out, y, reduction="sum").item()
            correct += (out.argmax(1) == y).sum().item()
            n += len(y)
    return {"accuracy": correct / n, "loss": loss / n, "samples": n, "split": split,
            "model": cfg.model, "dataset": cfg.dataset, "device": str(dev),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "device_name": torch.cuda.get_device_name(0) if use_cuda else "cpu"}


def _concat(a, b):
    if isinstance(a, TensorData) and isinstance(b, TensorData):
        return torch.utils.data.TensorDataset(torch.cat([a.x, b.x]), torch.cat([a.y, b.y]))
    return torch.utils.data.ConcatDataset([a, b])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a gpuflow checkpoint file")
    p.add_argument("--split", choices=["val", "all"], default="val")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dataset", help="evaluate on another dataset than the one trained on")
    p.add_argument("--data-root")
    a = p.parse_args(argv)
    try:
        res = evaluate(a.checkpoint, a.split, a.device, dataset=a.dataset, data_root=a.data_root)
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
