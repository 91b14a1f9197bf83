"""Seeds and determinism switches, set once per process before the model is built."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from .config import TrainConfig


def seed_everything(seed: int) -> None:
    """Seed Python, numpy, torch and every CUDA device."""
    random.seed(seed)
    np.random.seed(seed)  # TrainConfig bounds it to NumPy's 32 bits
    torch.manual_seed(seed)


def set_determinism(cfg: TrainConfig) -> None:
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # required by cuBLAS
        torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = cfg.deterministic
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark and not cfg.deterministic
