"""Prepared datasets: the flow reads a downloaded source once into `{data_root}/.gpuflow-cache/{dataset}-{key}.pt`,
with a `.json` description, and workers load that (the digits, small, each worker reads itself). `key` hashes the
source files' sizes and mtimes and the library version; a file whose bytes no longer match the recorded sha256
counts as missing. No torch at module level."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .errors import DatasetError
from .files import atomic_write

FORMAT = 2  # 2: the description records the classes present
SYNTHETIC_VERSION = 1  # bump when training/data.py `_synthetic` changes what it generates
# the sources prepared once: synthetic is generated and digits read from its small file by each worker (torch-free
# in the flow); imagefolder stays lazy
TORCHVISION_FOLDERS = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST", "cifar10": "cifar-10-batches-py"}
CACHE_DIR = ".gpuflow-cache"


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _stat(p: Path, base: Path) -> list:
    st = p.stat()
    return [str(p.relative_to(base)), st.st_size, st.st_mtime_ns]


def digits_csv() -> Path | None:
    """The 8x8 digits file scikit-learn ships (what its load_digits reads), found without importing it; None
    when it is not installed."""
    spec = importlib.util.find_spec("sklearn")
    csv = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    return csv if csv and csv.is_file() else None


def digits_arrays():
    """scikit-learn's load_digits as numpy arrays, images (N, 1, 8, 8) float32 in [0, 1] and int64 labels, read from
    the file it ships without importing it (slow); its own loader where a release keeps the file elsewhere."""
    import numpy as np

    if (csv := digits_csv()) is not None:
        table = np.loadtxt(csv, delimiter=",")  # 64 pixels (0-16), then the label
        pixels, labels = table[:, :-1], table[:, -1]
    else:
        try:
            from sklearn.datasets import load_digits
        except ImportError:
            raise DatasetError("dataset 'digits' ships with scikit-learn, which is not installed: "
                               "pip install scikit-learn") from None
        pixels, labels = load_digits(return_X_y=True)
    return pixels.reshape(-1, 1, 8, 8).astype(np.float32) / np.float32(16), labels.astype(np.int64)


def digits_description() -> dict:
    """The digits' description, torch-free: its sha256 is the workers' fingerprint of the same tensors."""
    x, y = digits_arrays()
    h = hashlib.sha256(x.tobytes())
    h.update(y.tobytes())
    return {"num_samples": len(y), "num_classes": 10, "classes": [str(v) for v in sorted(set(y.tolist()))],
            "native_shape": list(x.shape[1:]), "sha256": h.hexdigest()}


def source_signature(dataset: str, data_root: str) -> dict | None:
    """What the source is made of, without reading it; None when it is not on disk (yet)."""
    if dataset not in TORCHVISION_FOLDERS:
        return None
    folder = Path(data_root).expanduser().resolve() / TORCHVISION_FOLDERS[dataset]
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    if not files:
        return None
    return {"dataset": dataset, "torchvision": _version("torchvision"), "folder": str(folder),
            "files": [_stat(p, folder) for p in files]}


def check_sizes(counts: str, n_train: int, n_val: int, world_size: int, fix: str) -> None:
    """DatasetError when a process would get an empty training or validation shard; `counts` says what the dataset
    holds, `fix` what the user can do."""
    if n_train >= world_size and n_val >= world_size:
        return
    each = f"{world_size} (one per process)" if world_size > 1 else "1"
    fewer = ", or run fewer processes" if world_size > 1 else ""
    raise DatasetError(f"{counts}, but training and validation each need at least {each}: {fix}{fewer}")


def synthetic_description(size: int, side: int) -> dict:
    """The synthetic set's description without generating it: its fingerprint hashes its definition."""
    definition = ["synthetic", SYNTHETIC_VERSION, _version("torch"), int(size), int(side)]
    return {"num_samples": int(size), "num_classes": 10, "native_shape": [1, int(side), int(side)],
            "sha256": hashlib.sha256(json.dumps(definition).encode()).hexdigest()}


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes (read in chunks)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def paths(dataset: str, data_root: str, signature: dict) -> tuple[Path, Path]:
    key = hashlib.sha256(json.dumps([FORMAT, signature], sort_keys=True).encode()).hexdigest()[:16]
    base = Path(data_root).expanduser().resolve() / CACHE_DIR / f"{dataset}-{key}"
    return base.with_suffix(".pt"), base.with_suffix(".json")


def lookup(dataset: str, data_root: str) -> tuple[Path, dict] | None:
    """(the prepared file, its description) when one matches the source as it is now, bytes intact; else None."""
    sig = source_signature(dataset, data_root)
    if sig is None:
        return None
    pt, meta_path = paths(dataset, data_root, sig)
    try:
        meta = json.loads(meta_path.read_text())
        if (meta.get("format") == FORMAT and meta.get("signature") == sig
                and pt.stat().st_size == meta["file_size"] and file_sha256(pt) == meta["file_sha256"]):
            return pt, meta
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def store(dataset: str, data_root: str, x, y, num_classes: int, fingerprint: dict, classes: list[str]) -> Path | None:
    """Write the prepared file (atomically: concurrent runs may race) and its description; its path.

    None, and the workers read the source, when there is no signature or the folder is not writable; a full disk
    raises DiskFull."""
    import torch

    sig = source_signature(dataset, data_root)
    if sig is None:
        return None
    pt, meta_path = paths(dataset, data_root, sig)
    try:
        digest = {}

        def write(tmp: Path) -> None:
            # through a file object: the archive's inner name is fixed, so the same data gives the same bytes
            with open(tmp, "wb") as f:
                torch.save({"x": x.contiguous(), "y": y.contiguous(), "num_classes": int(num_classes)}, f)
            digest["sha256"], digest["size"] = file_sha256(tmp), tmp.stat().st_size

        atomic_write(pt, write)
        meta = {"format": FORMAT, "signature": sig, "file_size": digest["size"], "file_sha256": digest["sha256"],
                "num_samples": int(len(y)), "num_classes": int(num_classes), "classes": list(classes),
                "native_shape": [int(d) for d in x.shape[1:]], "dtype": str(x.dtype).removeprefix("torch."),
                "sha256": fingerprint["sha256"]}
        atomic_write(meta_path, lambda tmp: tmp.write_text(json.dumps(meta, indent=1)))
    except OSError:  # not DiskFull (a UserError): a full disk stops the run here, not at its first save
        return None
    return pt


def load(path: str):
    """(x, y, num_classes) from a prepared file; weights_only: tensors and ints, nothing else."""
    import torch

    try:
        d = torch.load(path, map_location="cpu", weights_only=True)
        return d["x"], d["y"], int(d["num_classes"])
    except Exception as e:  # unpickling, truncation, missing keys: all mean 'rebuild it'
        raise DatasetError(
            f"prepared dataset file {path!r} could not be read ({type(e).__name__}: {e}). Delete it "
            "and run the flow again: its data step writes a fresh one from the source."
        ) from None
