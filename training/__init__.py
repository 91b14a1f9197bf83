"""gpuflow's worker side: pure torch + stdlib + mlflow client. Never imports prefect."""

from .config import TrainConfig

__all__ = ["TrainConfig"]
