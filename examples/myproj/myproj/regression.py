"""A regression: your model, data with dict samples, and your own loss and metrics."""

import torch
from torch import nn
from torch.utils.data import Dataset


class Regressor(nn.Module):
    def __init__(self, in_features: int = 8, hidden: int = 32):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(in_features, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.layers(x)


class Points(Dataset):
    """Samples are dicts: "x" goes to the model as forward(x=...), "target" to the loss."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        w = torch.linspace(-1, 1, 8)
        self.y = (self.x @ w).unsqueeze(1) + 0.05 * torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "target": self.y[i]}


def datasets(root: str):
    return Points(700, seed=1), Points(201, seed=2)


class MSE:
    """Loss: the batch mean. metrics: per-batch (sum, count), reduced exactly over all ranks.
    epoch_metrics: on the whole validation set, gathered once an epoch."""

    monitor, mode = "mae", "min"  # what the retrain flow compares

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)

    def metrics(self, output, target):
        return {"mae": ((output - target).abs().sum(), len(target))}

    def epoch_metrics(self, outputs, targets):
        residual = ((outputs - targets) ** 2).sum()
        total = ((targets - targets.mean()) ** 2).sum()
        return {"r2": float(1 - residual / total)}
