"""A user's map-style dataset for the benchmark: feature vectors read one sample at a time,
batched by the DataLoader's default collate (as most user datasets are)."""

from pathlib import Path

import torch
from torch.utils.data import Dataset

FILE = "benchnet.pt"


def write(root: str, size: int, features: int = 784, classes: int = 10) -> None:
    """The benchmark's stand-in for prepare_data: `size` samples, 10 classes, fixed seed."""
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, classes, (size,), generator=g)
    x = torch.randn(classes, features, generator=g)[y] + torch.randn(size, features, generator=g)
    Path(root).mkdir(parents=True, exist_ok=True)
    torch.save({"x": x, "y": y}, Path(root) / FILE)


class Features(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y
        self.classes = list(range(10))

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def datasets(root: str):
    d = torch.load(Path(root) / FILE, weights_only=True)
    n = len(d["y"]) * 4 // 5
    return Features(d["x"][:n], d["y"][:n]), Features(d["x"][n:], d["y"][n:])
