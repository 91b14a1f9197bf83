"""Prepared datasets: the flow reads a named source once into one tensor file; workers load that.

    {data_root}/.gpuflow-cache/{dataset}-{key}.pt     {"x": N,C,H,W, "y": N, "num_classes": K}
    {data_root}/.gpuflow-cache/{dataset}-{key}.json   what the flow needs, without torch

`key` hashes the source's signature: the library version and the size and mtime of every
source file (scikit-learn's digits file, or the files under the torchvision folder). Editing,
replacing or re-downloading the source changes the key, so a stale file is never read.
The description also records the sha256 of the prepared file's bytes (`file_sha256`); a file
whose bytes no longer match (a flipped bit, an edit, a half-copied folder) counts as missing
and is rebuilt. `sha256` stays the fingerprint of the data itself (training/data.py).

Why: every worker otherwise imports scikit-learn (~1.2 s) or torchvision and decodes the
source again, and the flow does it too to fingerprint the data, on every run. With the file
prepared, the flow's data step on a later run is a few stat calls, a JSON read and one sha256
of the file (no torch, no scikit-learn), and each worker loads one tensor file. Nothing here
imports torch at module level: the flow uses `lookup` before torch is loaded.
"""

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
CACHED = ("digits", "mnist", "fashion-mnist", "cifar10")  # synthetic is generated; imagefolder stays lazy
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


def source_signature(dataset: str, data_root: str) -> dict | None:
    """What the source is made of, without reading it; None when it is not on disk (yet)."""
    if dataset == "digits":
        spec = importlib.util.find_spec("sklearn")
        if spec is None or not spec.origin:
            return None
        data = Path(spec.origin).parent / "datasets" / "data"
        files = [_stat(data / "digits.csv.gz", data)] if (data / "digits.csv.gz").is_file() else []
        return {"dataset": dataset, "scikit-learn": _version("scikit-learn"), "files": files}
    if dataset in TORCHVISION_FOLDERS:
        folder = Path(data_root).expanduser().resolve() / TORCHVISION_FOLDERS[dataset]
        files = sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []
        if not files:
            return None
        return {"dataset": dataset, "torchvision": _version("torchvision"), "folder": str(folder),
                "files": [_stat(p, folder) for p in files]}
    return None


def check_sizes(counts: str, n_train: int, n_val: int, world_size: int, fix: str) -> None:
    """Each process trains on a shard of the training set and validates on a shard of the
    validation set: refuse, before any starts, a dataset leaving one of them an empty shard.
    `counts` says what the dataset holds, `fix` what the user can do; every dataset, built-in
    or the user's, goes through this one rule."""
    if n_train >= world_size and n_val >= world_size:
        return
    each = f"{world_size} (one per process)" if world_size > 1 else "1"
    fewer = ", or run fewer processes" if world_size > 1 else ""
    raise DatasetError(f"{counts}, but training and validation each need at least {each}: {fix}{fewer}")


def synthetic_description(size: int, side: int) -> dict:
    """The synthetic set without generating it: it is defined by its size, side and generator
    (training/data.py `_synthetic`, seeded), so its fingerprint is that definition's hash."""
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
    """The prepared file and its description, when one matches the source as it is now and
    its bytes are those recorded when it was written."""
    if dataset not in CACHED:
        return None
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


def store(dataset: str, data_root: str, x, y, num_classes: int, fingerprint: dict,
          classes: list[str]) -> Path | None:
    """Write the prepared file (atomically: concurrent runs may race) and its description.

    Returns None, and the workers read the source themselves, when there is no signature or
    the folder is not writable. A full disk raises DiskFull (training/files.py), leaving no temp file.
    """
    import torch

    sig = source_signature(dataset, data_root) if dataset in CACHED else None
    if sig is None:
        return None
    pt, meta_path = paths(dataset, data_root, sig)
    try:
        digest = {}

        def write(tmp: Path) -> None:
            # Through a file object: the archive's inner name is then fixed ("archive"), not the
            # random temp name, so the same data always gives the same bytes (and file_sha256).
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
