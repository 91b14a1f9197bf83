"""Your data: `prepare_data(root)` runs once, in the flow, before any training process
starts (download, extract, index); `datasets(root)` runs in every process and only opens
what is there."""

from pathlib import Path

import torch
from torch.utils.data import Dataset

FILE = "myproj-blobs.pt"


def prepare_data(root: str) -> None:
    """Stands in for a download: writes three Gaussian blobs in 8 dimensions under root."""
    path = Path(root) / FILE
    if path.exists():
        return
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(3, 8, generator=g) * 3
    y = torch.arange(900) % 3
    x = centers[y] + torch.randn(900, 8, generator=g)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"x": x, "y": y}, tmp)
    tmp.rename(path)  # complete or absent, never half a file


class Blobs(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y
        self.classes = ["a", "b", "c"]  # torchvision's convention: gpuflow reads num_classes from it

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def datasets(root: str):
    path = Path(root) / FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: prepare_data did not run")
    d = torch.load(path, weights_only=True)
    return Blobs(d["x"][:750], d["y"][:750]), Blobs(d["x"][750:], d["y"][750:])
