"""Datasets by name, a deterministic train/validation split, and fast loaders: built-in sets are one in-memory
tensor, batches gathered by index in one shot; `imagefolder:<path>` stays lazy."""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, Subset

from . import datacache, refs
from .config import TrainConfig, input_shape_for, val_count
from .errors import DatasetError
from .userdata import DataBundle, user_datasets

IMAGEFOLDER_SIZE = 64  # square side images from an ImageFolder are resized to


class TensorData(Dataset):
    """In-memory samples; indexing with a list of indices returns a whole batch."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, idx):
        if self.x.is_cuda and isinstance(idx, list):
            # pinned and copied without waiting: a copy from pageable memory waits for the queued kernels, every step
            idx = torch.tensor(idx).pin_memory().to(self.x.device, non_blocking=True)
        return self.x[idx], self.y[idx]


GPU_DATA_SHARE = 0.25  # in-memory data moves to the GPU when it takes at most this share of free memory


def data_to_device(bundle: DataBundle, device: torch.device, num_workers: int) -> tuple[DataBundle, bool]:
    """Put in-memory datasets on the GPU once, when they fit, and say whether it did.

    Batches are then gathered there, with no per-step host-to-device copy (bench/RESULTS_GPU.md)."""
    parts = (bundle.train, bundle.val)
    if device.type != "cuda" or num_workers > 0 or not all(isinstance(d, TensorData) for d in parts):
        return bundle, False
    need = sum(t.numel() * t.element_size() for d in parts for t in (d.x, d.y))
    free, _ = torch.cuda.mem_get_info(device)
    if need > GPU_DATA_SHARE * free:
        return bundle, False
    train, val = (TensorData(d.x.to(device), d.y.to(device)) for d in parts)
    return replace(bundle, train=train, val=val), True


# --- raw sources: each returns (images N,C,H,W: float in [0,1] or uint8, labels N int64, classes) ---


def _digits(cfg: TrainConfig):
    x, y = datacache.digits_arrays()
    return torch.from_numpy(x), torch.from_numpy(y), 10


def _synthetic(cfg: TrainConfig):
    # Learnable on purpose: labels are the argmax of a fixed random projection.
    g = torch.Generator().manual_seed(1234)
    side = cfg.synthetic_side
    x = torch.rand(cfg.synthetic_size, 1, side, side, generator=g)
    w = torch.randn(side * side, 10, generator=g)
    y = ((x.flatten(1) - 0.5) @ w).argmax(1)
    return x, y, 10


def _torchvision(cfg: TrainConfig):
    from torchvision import datasets

    cls = {"mnist": datasets.MNIST, "fashion-mnist": datasets.FashionMNIST, "cifar10": datasets.CIFAR10}[cfg.dataset]
    root = Path(cfg.data_root).expanduser()
    try:
        ds = cls(root=str(root), train=True, download=cfg.download)
    except RuntimeError as e:
        raise DatasetError(
            f"dataset {cfg.dataset!r} not found under {str(root.resolve())!r} ({e}). "
            f"Put the torchvision files there, or set download=True on a machine with "
            f"internet access, or use the offline dataset 'digits'."
        ) from None
    data = torch.as_tensor(ds.data)
    x = data.unsqueeze(1) if data.ndim == 3 else data.permute(0, 3, 1, 2)
    return x.contiguous(), torch.as_tensor(ds.targets, dtype=torch.int64), len(ds.classes)  # uint8


SOURCES = {"digits": _digits, "synthetic": _synthetic, "mnist": _torchvision,
           "fashion-mnist": _torchvision, "cifar10": _torchvision}


def fit_images(x: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    """Convert N,C,H,W images in [0,1] to the model's channels and size, then normalise."""
    c, h, w = shape
    if x.shape[1] != c:
        x = x.mean(1, keepdim=True) if c == 1 else x.expand(-1, c, -1, -1)
    if x.shape[2:] != (h, w):
        x = F.interpolate(x, size=(h, w), mode="bilinear", align_corners=False, antialias=True)
    return ((x - 0.5) / 0.5).contiguous()


def _fingerprint(name: str, *tensors: torch.Tensor) -> dict:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().numpy().tobytes())
    return {"name": name, "num_samples": len(tensors[-1]), "sha256": h.hexdigest()}


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic split: the same (n, fraction, seed) always gives the same halves."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = val_count(n, val_fraction)
    return perm[n_val:], perm[:n_val]


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x.float() / 255.0 if x.dtype == torch.uint8 else x


def present_classes(y: torch.Tensor) -> list[str]:
    """The labels that occur in `y`, as strings (a source may declare more than it holds)."""
    return [str(v) for v in torch.unique(y).tolist()]


def prepare(cfg: TrainConfig) -> dict:
    """The flow's data step: read the source once, fingerprint it, write the prepared file (named sources only).

    {"cache": path or None, "num_samples", "num_classes", "classes" (those present), "input_shape", "sha256"}.
    Every image of an image folder is decoded once here, so a bad file stops the run before it starts."""
    if cfg.dataset.startswith("imagefolder:"):
        b = _load_imagefolder(cfg)
        folder = b.train.dataset
        check_images(cfg.dataset, [p for p, _ in folder.samples])
        return {"cache": None, "num_samples": b.fingerprint["num_samples"], "num_classes": b.num_classes,
                "classes": list(folder.classes), "input_shape": list(b.input_shape), "sha256": b.fingerprint["sha256"]}
    x, y, num_classes = SOURCES[cfg.dataset](cfg)
    fp = _fingerprint(cfg.dataset, _unit(x), y)
    classes = present_classes(y)
    path = datacache.store(cfg.dataset, cfg.data_root, x, y, num_classes, fp, classes)
    return {"cache": str(path) if path else None, "num_samples": len(y), "num_classes": num_classes,
            "classes": classes, "input_shape": list(input_shape_for(cfg.model, tuple(x.shape[1:]))),
            "sha256": fp["sha256"]}


def load_data(cfg: TrainConfig, fingerprint: bool = True) -> DataBundle:
    """Load (from `cfg.data_cache` when set), split and shape the dataset named in `cfg` for `cfg.model`.

    fingerprint=False skips hashing the data (workers: the flow recorded it)."""
    if refs.is_reference(cfg.dataset):
        return user_datasets(cfg)
    if cfg.dataset.startswith("imagefolder:"):
        return _load_imagefolder(cfg)
    x, y, num_classes = datacache.load(cfg.data_cache) if cfg.data_cache else SOURCES[cfg.dataset](cfg)
    x = _unit(x)
    fp = _fingerprint(cfg.dataset, x, y) if fingerprint else {}
    shape = input_shape_for(cfg.model, tuple(x.shape[1:]))
    x = fit_images(x, shape)
    train, val = (TensorData(x[i], y[i]) for i in split_indices(len(y), cfg.val_fraction, cfg.split_seed))
    return DataBundle(train, val, num_classes, shape, fp)


def _load_imagefolder(cfg: TrainConfig) -> DataBundle:
    from torchvision import datasets, transforms
    from torchvision.datasets.folder import IMG_EXTENSIONS

    root = Path(cfg.dataset.split(":", 1)[1]).expanduser()
    if not root.is_dir():
        raise DatasetError(f"imagefolder path {str(root)!r} is not a folder; expected <path>/<class>/<image>")
    if not any(p.is_dir() for p in root.iterdir()):
        raise DatasetError(f"imagefolder {str(root)!r} has no class folders; expected <path>/<class>/<image>, "
                           "one folder of images per class")
    shape = input_shape_for(cfg.model, (3, IMAGEFOLDER_SIZE, IMAGEFOLDER_SIZE))
    c, h, w = shape
    tf = transforms.Compose([
        transforms.Grayscale(1) if c == 1 else transforms.Lambda(lambda im: im.convert("RGB")),
        transforms.Resize((h, w)),
        transforms.ToTensor(),
        transforms.Normalize([0.5] * c, [0.5] * c),
    ])
    ds = datasets.ImageFolder(str(root), transform=tf, allow_empty=True)  # empty classes: our message
    empty = sorted(set(ds.classes) - {ds.classes[label] for _, label in ds.samples})
    if empty:
        raise DatasetError(f"imagefolder {str(root)!r}: class folder(s) {', '.join(map(repr, empty))} hold no "
                           f"images ({' '.join(IMG_EXTENSIONS)}); add images or remove the folder(s)")
    h_ = hashlib.sha256()
    for p, label in ds.samples:  # paths, sizes and labels: cheap and catches edits
        h_.update(f"{Path(p).relative_to(root)}:{Path(p).stat().st_size}:{label}".encode())
    fp = {"name": cfg.dataset, "num_samples": len(ds), "sha256": h_.hexdigest()}
    train, val = (Subset(ds, i) for i in split_indices(len(ds), cfg.val_fraction, cfg.split_seed))
    return DataBundle(train, val, len(ds.classes), shape, fp)


def _decode_error(path: str) -> str | None:
    """Why the image at `path` cannot be decoded, or None when it can."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.draft(None, (IMAGEFOLDER_SIZE, IMAGEFOLDER_SIZE))  # JPEGs decode at reduced scale: whole stream, fast
            im.load()
    except Exception as e:  # any decoder error is one the workers' loader would hit mid-epoch
        return " ".join(f"{type(e).__name__}: {e}".split())
    return None


def check_images(dataset: str, files: list[str]) -> None:
    """Decode every image once (in threads: PIL releases the GIL); name the first bad file and count the rest."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        bad = [(f, why) for f, why in zip(files, pool.map(_decode_error, files), strict=True) if why]
    if bad:
        more = f" (and {len(bad) - 1} more unreadable images)" if len(bad) > 1 else ""
        raise DatasetError(f"dataset {dataset!r}: image {bad[0][0]!r} cannot be read ({bad[0][1]}){more}; "
                           "replace or delete it and run again")


# --- loaders -------------------------------------------------------------------------


def _loader(ds: Dataset, sampler, batch_size: int, cfg: TrainConfig, pin: bool, rank: int, start_epoch: int):
    # Each worker's torch, random and numpy seeds derive from this generator: reproducible, yet no two ranks' workers
    # draw the same random augmentations, and a resumed run does not replay the draws of its first epochs.
    import numpy as np

    seed = int(np.random.SeedSequence([cfg.seed, rank, start_epoch]).generate_state(1)[0])
    common = dict(num_workers=cfg.num_workers, pin_memory=pin, persistent_workers=cfg.num_workers > 0,
                  generator=torch.Generator().manual_seed(seed))
    if isinstance(ds, TensorData):
        # One __getitem__ per batch: the sampler yields lists of indices.
        return DataLoader(ds, sampler=BatchSampler(sampler, batch_size, drop_last=False), batch_size=None, **common)
    return DataLoader(ds, sampler=sampler, batch_size=batch_size, **common)


def train_loader(ds: Dataset, cfg: TrainConfig, rank: int, world: int, pin: bool, start_epoch: int = 0):
    """(loader, sampler), shuffled by (seed, epoch) alone and rank-sharded; call sampler.set_epoch(epoch) first.
    `start_epoch`: the epochs already trained (a resumed run)."""
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed)
    return _loader(ds, sampler, cfg.batch_size // world, cfg, pin, rank, start_epoch), sampler


def val_loader(ds: Dataset, cfg: TrainConfig, rank: int, world: int, pin: bool) -> DataLoader:
    # every `world`-th index from `rank`: each sample on exactly one rank, no padding
    return _loader(ds, range(rank, len(ds), world), max(1, cfg.batch_size // world), cfg, pin, rank, 0)
