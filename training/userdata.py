"""The user's own datasets: a factory `datasets(root)` named by reference, and the optional `prepare_data(root)`
hook in its module (see docs/your-code.md)."""

from __future__ import annotations

import hashlib
import inspect
import sys
from dataclasses import dataclass, field

from torch.utils.data import Dataset

from . import refs
from .config import TrainConfig
from .errors import DatasetError
from .objective import first_tensor, split_batch


@dataclass
class DataBundle:
    """What loading a dataset gives, built-in or the user's."""

    train: Dataset
    val: Dataset
    num_classes: int
    input_shape: tuple[int, int, int]
    fingerprint: dict = field(default_factory=dict)


def _call_with_root(fn, root: str, what: str):
    """fn(root) when fn takes an argument (named root or positional), else fn()."""
    try:
        takes_root = bool(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        takes_root = True
    try:
        return fn(root) if takes_root else fn()
    except DatasetError:
        raise
    except Exception as e:
        raise DatasetError(f"{what} raised {refs.describe_error(e)}") from None


def prepare_user_data(cfg: TrainConfig) -> bool:
    """Run the dataset module's `prepare_data(root)` hook once, before any rank starts; whether it had one."""
    factory = refs.resolve(cfg.dataset, cfg.code_root, "dataset")
    hook = getattr(sys.modules.get(getattr(factory, "__module__", "") or ""), "prepare_data", None)
    if not callable(hook):
        return False
    _call_with_root(hook, cfg.data_root, f"dataset {cfg.dataset!r}: prepare_data({cfg.data_root!r})")
    return True


def user_datasets(cfg: TrainConfig) -> DataBundle:
    """Call the user's dataset factory, which returns (train, val) or {"train", "val"[, "num_classes"]}.

    num_classes: the factory's, else `len(train.classes)`, else the model's output size the preflight found.
    """
    factory = refs.resolve(cfg.dataset, cfg.code_root, "dataset")
    what = f"dataset {cfg.dataset!r}"
    out = _call_with_root(factory, cfg.data_root, f"{what}: calling it with root={cfg.data_root!r}")
    num_classes = None
    if isinstance(out, dict) and {"train", "val"} <= set(out):
        train, val, num_classes = out["train"], out["val"], out.get("num_classes")
    elif isinstance(out, (tuple, list)) and len(out) == 2:
        train, val = out
    else:
        got = f"a dict with keys {sorted(out)}" if isinstance(out, dict) else (
            f"a {type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list)) else f"a {type(out).__name__}")
        raise DatasetError(f"{what} returned {got}; return (train, val), two map-style datasets, "
                           "or {'train': ..., 'val': ..., 'num_classes': N}")
    for part, d in (("train", train), ("val", val)):
        if not (hasattr(d, "__getitem__") and hasattr(d, "__len__")):
            raise DatasetError(f"{what}: its {part} set is a {type(d).__name__}, not a map-style dataset "
                               "(__getitem__ and __len__); return torch.utils.data.Dataset objects")
        if len(d) == 0:
            raise DatasetError(f"{what}: its {part} set is empty; check the data under {cfg.data_root!r} "
                               "(did prepare_data run?)")
    if num_classes is None and getattr(train, "classes", None) is not None:
        num_classes = len(train.classes)
    num_classes = int(num_classes) if num_classes is not None else cfg.num_classes
    try:
        x = first_tensor(split_batch(train[0])[0])
    except Exception as e:
        raise DatasetError(f"{what}: reading its first training sample raised {refs.describe_error(e)}") from None
    shape = tuple(x.shape) if x is not None else None
    digest = hashlib.sha256(f"{cfg.dataset}:{len(train)}:{len(val)}".encode()).hexdigest()
    fp = {"name": cfg.dataset, "num_samples": len(train) + len(val), "sha256": digest}
    return DataBundle(train, val, num_classes, shape, fp)
