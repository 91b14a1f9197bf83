"""A user's model for the benchmark: not one of gpuflow's built-ins, named by reference
(`benchnet.nets:Net`). gpuflow passes num_classes and input_shape because the signature names them."""

from torch import nn


class Net(nn.Module):
    def __init__(self, hidden: int = 256, num_classes: int = 10, input_shape: list[int] = (784,)):
        super().__init__()
        self.fc1 = nn.Linear(input_shape[0], hidden)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.fc2(self.relu(self.fc1(x)))
