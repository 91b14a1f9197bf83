"""The built-in models; `mlp` is exactly the seeds' SimpleNN, so its checkpoints load into it.
Torch and torchvision only: the registered model ships this file, so it loads where gpuflow is not installed."""

from __future__ import annotations

import torch
from torch import nn


class SimpleNN(nn.Module):
    """The seeds' model: Linear(784, 256) - ReLU - Linear(256, 10)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(784, 256)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(256, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.fc1(x.flatten(1))))


def _pool_matrix(n_in: int, n_out: int, like: torch.Tensor) -> torch.Tensor:
    """(n_out, n_in) averaging matrix with adaptive pooling's bins: [floor(i*n/o), ceil((i+1)*n/o))."""
    m = torch.zeros(n_out, n_in, dtype=like.dtype, device=like.device)
    for i in range(n_out):
        lo, hi = (i * n_in) // n_out, -((-(i + 1) * n_in) // n_out)
        m[i, lo:hi] = 1.0 / (hi - lo)
    return m


class AdaptiveAvgPool2d(nn.AdaptiveAvgPool2d):
    """nn.AdaptiveAvgPool2d that also trains under `deterministic=True` on CUDA, where the stock backward raises.

    In that mode it averages as two matrix products (P_h @ x @ P_w^T); no parameters, so state dicts are unchanged.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (x.is_cuda and x.requires_grad and torch.are_deterministic_algorithms_enabled()):
            return super().forward(x)
        oh, ow = (self.output_size, self.output_size) if isinstance(self.output_size, int) else self.output_size
        h, w = x.shape[-2:]
        oh, ow = oh or h, ow or w
        return _pool_matrix(h, oh, x) @ x @ _pool_matrix(w, ow, x).T


class SmallCNN(nn.Module):
    """Two conv blocks and a linear head; adaptive pooling makes it size-agnostic."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
            AdaptiveAvgPool2d(4),
        )
        self.head = nn.Linear(64 * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def resnet18(num_classes: int = 10) -> nn.Module:
    """torchvision's resnet18, untrained (no download), with a pooling that trains deterministically."""
    from torchvision.models import resnet18 as tv_resnet18

    model = tv_resnet18(weights=None, num_classes=num_classes)
    model.avgpool = AdaptiveAvgPool2d((1, 1))  # same result; trains under deterministic=True
    return model


def builtin_spec(name: str, num_classes: int, input_shape: tuple[int, ...]) -> tuple[str, dict]:
    """(the attribute of this module that builds model `name`, its keyword arguments)."""
    if name == "mlp":
        return "SimpleNN", {"num_classes": num_classes}
    if name == "cnn":
        return "SmallCNN", {"in_channels": input_shape[0], "num_classes": num_classes}
    if name == "resnet18":
        return "resnet18", {"num_classes": num_classes}
    raise ValueError(f"unknown model {name!r}; choose mlp, cnn or resnet18")
