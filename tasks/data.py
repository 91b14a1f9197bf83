"""Data preparation in the parent: download or verify once, before any worker starts."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field

from gpuflow.training import TrainConfig
from gpuflow.training.config import input_shape_for, val_count
from gpuflow.training.errors import DatasetError


class DatasetInfo(BaseModel):
    name: str
    root: str | None = None
    num_samples: int
    train_samples: int
    val_samples: int
    num_classes: int | None = Field(None, description="None: the dataset does not say (the model's output size "
                                                      "decides)")
    input_shape: list[int] | None = None
    sha256: str
    cache: str | None = Field(None, description="prepared file the workers read (training/datacache.py)")
    reused: bool = Field(False, description="the prepared file of an earlier run matched the source")


@task(name="prepare-dataset", retry_delay_seconds=5, cache_policy=NO_CACHE)
def prepare_dataset(cfg: TrainConfig) -> DatasetInfo:
    """Prepare the dataset once (download, verify, fingerprint), or reuse a matching prepared file; raises
    DatasetError for data that cannot train."""
    from gpuflow.training import datacache
    from gpuflow.training.refs import is_reference

    if is_reference(cfg.dataset):
        return describe_user_data(cfg)
    builtin = cfg.dataset in ("digits", "synthetic")
    found = datacache.lookup(cfg.dataset, cfg.data_root)
    if builtin or found:  # the built-ins are read (digits) or generated (synthetic) by each worker
        path, meta = found or (None, datacache.digits_description() if cfg.dataset == "digits" else
                               datacache.synthetic_description(cfg.synthetic_size, cfg.synthetic_side))
        d = {**meta, "cache": path and str(path),
             "input_shape": input_shape_for(cfg.model, tuple(meta["native_shape"]))}
    else:
        from gpuflow.training.data import prepare

        d = prepare(cfg)
    check_classes(cfg.dataset, d.get("classes"), d["num_samples"])  # synthetic: 10 by construction
    check_split(cfg, d["num_samples"])
    n, n_val = d["num_samples"], val_count(d["num_samples"], cfg.val_fraction)
    return DatasetInfo(
        name=cfg.dataset, root=None if builtin else cfg.data_root, num_samples=n,
        train_samples=n - n_val, val_samples=n_val, num_classes=d["num_classes"],
        input_shape=d["input_shape"], sha256=d["sha256"], cache=d["cache"], reused=bool(found),
    )


def describe_user_data(cfg: TrainConfig) -> DatasetInfo:
    """The user's dataset: its module's prepare_data(root) hook runs once, then its factory describes the sets."""
    from gpuflow.training.userdata import prepare_user_data, user_datasets

    prepare_user_data(cfg)
    b = user_datasets(cfg)
    return DatasetInfo(name=cfg.dataset, root=cfg.data_root, num_samples=len(b.train) + len(b.val),
                       train_samples=len(b.train), val_samples=len(b.val), num_classes=b.num_classes,
                       input_shape=b.input_shape, sha256=b.fingerprint["sha256"])


def check_classes(dataset: str, classes: list[str] | None, num_samples: int) -> None:
    """A classifier needs samples of at least two classes."""
    if classes is None or len(classes) > 1 or num_samples == 0:
        return
    fix = (f"add a folder of images per class under {dataset.split(':', 1)[1]!r}" if dataset.startswith("imagefolder:")
           else "check the source's labels, or choose another dataset")
    raise DatasetError(f"dataset {dataset!r} has only one class ({classes[0]!r}, all {num_samples} samples): "
                       f"a classifier needs at least 2; {fix}")


def check_split(cfg: TrainConfig, num_samples: int, world_size: int = 1) -> None:
    """A built-in dataset split by val_fraction must leave every process a training and a validation sample."""
    from gpuflow.training.datacache import check_sizes

    n_val = min(val_count(num_samples, cfg.val_fraction), num_samples)
    n_train = num_samples - n_val
    tune = "lower val_fraction" if n_train < world_size else "raise val_fraction"
    more = "raise synthetic_size" if cfg.dataset == "synthetic" else "add data"
    check_sizes(f"dataset {cfg.dataset!r} has {num_samples} samples; val_fraction {cfg.val_fraction} leaves {n_train} "
                f"for training and {n_val} for validation", n_train, n_val, world_size, f"{more}, {tune}")
