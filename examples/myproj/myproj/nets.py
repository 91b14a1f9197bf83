"""Your models: plain nn.Module classes. gpuflow passes `num_classes` and `input_shape` to
those that name them, and everything in --model-args."""

from torch import nn


class Net(nn.Module):
    """A small classifier of feature vectors."""

    def __init__(self, width: int = 64, num_classes: int = 3, input_shape: list[int] = (8,)):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(input_shape[0], width), nn.ReLU(), nn.Linear(width, num_classes))

    def forward(self, x):
        return self.layers(x)
