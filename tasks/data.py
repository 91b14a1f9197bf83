"""Data preparation in the parent: download or verify once, before any worker starts."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from training import TrainConfig


class DatasetInfo(BaseModel):
    name: str
    root: str | None = None
    num_samples: int
    train_samples: int
    val_samples: int
    num_classes: int
    input_shape: list[int]
    sha256: str


def describe_dataset(cfg: TrainConfig) -> DatasetInfo:
    """Load (and, if asked, download) the dataset once; fingerprint what the workers will see."""
    from training.data import load_data

    b = load_data(cfg)
    builtin = cfg.dataset in ("digits", "synthetic")
    return DatasetInfo(
        name=cfg.dataset, root=None if builtin else cfg.data_root,
        num_samples=b.fingerprint["num_samples"], train_samples=len(b.train),
        val_samples=len(b.val), num_classes=b.num_classes, input_shape=list(b.input_shape),
        sha256=b.fingerprint["sha256"],
    )


@task(name="prepare-dataset", retry_delay_seconds=5, cache_policy=NO_CACHE)
def prepare_dataset(cfg: TrainConfig) -> DatasetInfo:
    """Download or verify the dataset once and record its fingerprint."""
    return describe_dataset(cfg)
