"""Checkpoints: one file per epoch, written atomically, loaded with weights_only=True. `model` never carries the
`module.` or `_orig_mod.` prefix, so it loads strictly into the plain model class."""

from __future__ import annotations

import fcntl
import io
import math
import os
import pickle
import random
import re
import zipfile
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from .errors import UserError
from .files import atomic_write

PREFIXES = ("module.", "_orig_mod.")
NAME = re.compile(r"^epoch-(\d+)\.pt$")


class CheckpointError(UserError):
    """A checkpoint cannot be used; the message names the file and what to do."""


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside DataParallel / DDP / torch.compile wrappers (a model's own submodule named `module`
    is its own)."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


def to_cpu(obj):
    """A copy of nested dicts/lists with every tensor copied to the CPU: it stays as it is while training goes on."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        out = type(obj)((k, to_cpu(v)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):  # module versions, kept as state_dict() has them
            out._metadata = obj._metadata
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def clean_state_dict(state: dict) -> OrderedDict:
    """Copy of `state` without the prefix a wrapper puts on every key (repeatedly: DDP around compile)."""
    state = OrderedDict(state)
    state.pop("_metadata", None)
    while state and (p := next((p for p in PREFIXES if all(k.startswith(p) for k in state)), None)):
        consume_prefix_in_state_dict_if_present(state, p)
    return state


def load_model_state(model: nn.Module, state: dict, source: str = "checkpoint") -> None:
    """Load a (possibly prefixed) state dict into `model` or its wrapper, strictly."""
    target = unwrap(model)
    expected = set(target.state_dict())
    if set(state) != expected:  # as saved by a wrapper; or stripped of a prefix that is the model's own
        state = clean_state_dict(state)
        if own := next((p for p in PREFIXES if {p + k for k in state} == expected), None):  # a child named module
            state = OrderedDict((own + k, v) for k, v in state.items())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{source} does not fit model {type(target).__name__}: "
            f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}. "
            "Was it saved from another architecture? Pick the matching model or another file."
        )
    try:
        target.load_state_dict(state, strict=True)
    except RuntimeError as e:  # same keys, other shapes
        raise CheckpointError(f"{source} does not fit model {type(target).__name__}: {e}") from None


def load_file(path: str | Path, map_location="cpu") -> dict:
    """torch.load with weights_only=True and errors a user can act on."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist; check the resume path")
    return _load(path, str(path), map_location)


def load_bytes(data: bytes, source: str, map_location="cpu") -> dict:
    """load_file for a checkpoint file's bytes (another rank's copy, `source` naming it): the same weights_only=True
    loader and errors, never a plain unpickling."""
    return _load(io.BytesIO(data), source, map_location)


def _load(f: Path | io.BytesIO, source: str, map_location) -> dict:
    try:
        return torch.load(f, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"unsupported (?:global: )?GLOBAL (\S+)", str(e), re.IGNORECASE)
        if found:  # a class or function reference: unpickling it could run code
            raise CheckpointError(
                f"refusing to load {source!r}: it contains pickled Python objects, not only "
                f"tensors (found {found.group(1)}), and loading it could run arbitrary code. "
                "Re-save it as a plain dict of tensors, e.g. {'model': model.state_dict()}"
            ) from None
        raise CheckpointError(f"checkpoint {source!r} is corrupt or not a torch file "
                              "(it does not unpickle); pick another file") from None
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        raise CheckpointError(f"checkpoint {source!r} is corrupt or truncated: {damage(f, e)}; use an "
                              "earlier checkpoint (--resume <file>), start afresh (--resume never), or pick "
                              "another file") from None


def damage(f: Path | io.BytesIO, error: Exception) -> str:
    """What is wrong with a file (or its bytes) torch cannot read, in words: empty, cut short, or damaged inside."""
    size = f.stat().st_size if isinstance(f, Path) else f.getbuffer().nbytes
    cause = str(error).strip().split(". ")[0] or type(error).__name__  # torch's first sentence; EOFError has none
    if size == 0:
        return "the file is empty (0 bytes)"
    if not zipfile.is_zipfile(f):  # torch.save writes a zip archive, whose index is at its end
        return (f"the file is incomplete: its {size} bytes stop before the end a whole torch file has (cut short "
                f"while written or copied; torch: {cause})")
    return f"the file ({size} bytes) is whole but damaged inside (torch: {cause})"


def rng_state() -> dict:
    """Every generator's state. "cuda" is this process's view of every visible card (DataParallel's replicas);
    "cuda_current" is the card it trains on, which under DDP is each rank's own: rank 0 saves the file, and every
    rank, seeded alike and drawing alike, restores its own card from rank 0's."""
    py = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "cuda_current": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict) -> None:
    """Restore every generator; the states must be CPU tensors (load the file with map_location='cpu')."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_s = state["numpy"]
    np.random.set_state((np_s[0], np_s[1].numpy().astype(np.uint32), *np_s[2:]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])
        if state.get("cuda_current") is not None:  # absent from files of gpuflow before 2026-11-28
            torch.cuda.set_rng_state(state["cuda_current"])


def _torch_save(payload: dict, path: Path) -> None:
    # Through a Python file: a full disk is then an OSError (ENOSPC), not torch's bare RuntimeError.
    with open(path, "wb") as f:
        torch.save(payload, f)


def save_file(path: str | Path, payload) -> Path:
    """torch.save atomically (never half a file); a full disk raises DiskFull naming the file."""
    return atomic_write(path, lambda tmp: _torch_save(payload, tmp))


def model_state(model: nn.Module) -> dict:
    """The unwrapped model's state dict (no DP/DDP/compile prefix), as CPU tensors."""
    return to_cpu(unwrap(model).state_dict())


class CheckpointStore:
    """Epoch checkpoints in one folder: `epoch-0001.pt`, ... Only complete files count."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._lock = None

    def claim(self) -> None:
        """Hold the folder for this process's lifetime (a second worker is refused) and remove a killed writer's
        temp files."""
        self.folder.mkdir(parents=True, exist_ok=True)
        f = open(self.folder / ".lock", "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise CheckpointError(f"checkpoint_dir {str(self.folder)!r} is in use by another worker (pid "
                                  f"{holder}); give each run its own folder, or wait for that one") from None
        f.truncate(0)
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._lock = f
        for tmp in self.folder.glob(".*.tmp"):
            tmp.unlink(missing_ok=True)

    def path_for(self, epoch: int) -> Path:
        return self.folder / f"epoch-{epoch:04d}.pt"

    def save(self, payload: dict, epoch: int) -> Path:
        """Write epoch `epoch`'s file atomically; a full disk raises DiskFull naming the file."""
        return save_file(self.path_for(epoch), payload)

    def epochs(self) -> list[int]:
        """The epochs of the complete checkpoints in the folder, oldest first."""
        return sorted(int(m.group(1)) for p in self.folder.glob("epoch-*.pt") if (m := NAME.match(p.name)))

    def retain(self, newest: int, history: list[dict], key: str, mode: str) -> None:
        """Delete every epoch's checkpoint but the `newest` and the best by `key` in `history` (`mode`: min/max)."""
        epochs = self.epochs()
        keep = set(epochs[-newest:])
        scored = [h for h in history if isinstance(h.get(key), float) and math.isfinite(h[key])]  # NaN is never best
        if scored:
            keep.add((max if mode == "max" else min)(scored, key=lambda h: h[key])["epoch"])
        for epoch in epochs:
            if epoch not in keep:
                self.path_for(epoch).unlink(missing_ok=True)

    def resume_path(self, resume: str, restarted: bool) -> str | Path | None:
        """What a worker resumes from: a first attempt, what `resume` says (auto: the folder's newest, if any); a
        restart (`restarted`) continues from the folder's newest once it has one, whatever `resume` says. A first
        attempt that would not continue the folder's newest is refused a folder holding checkpoints already."""
        epochs = self.epochs()
        latest = self.path_for(epochs[-1]) if epochs else None
        if not restarted and resume != "auto":
            if latest is not None and (resume == "never" or Path(resume).resolve() != latest.resolve()):
                # its files would be overwritten, retention would keep theirs over this run's (higher epochs), and a
                # restart would continue from them
                start = "starting afresh" if resume == "never" else f"starting from {resume!r}"
                raise CheckpointError(f"checkpoint_dir {str(self.folder)!r} holds checkpoints already (epochs "
                                      f"{epochs[0]}-{epochs[-1]}); {start} there would mix this run's epochs with "
                                      "them (the newest kept, and a restart's resume, would be theirs): give an empty "
                                      "checkpoint_dir (or move them away), or --resume auto to continue from the "
                                      "newest")
            return None if resume == "never" else resume
        return latest if latest is not None or resume in ("auto", "never") else resume

    def latest(self) -> Path | None:
        """Newest complete checkpoint (temp files never match the name pattern)."""
        epochs = self.epochs()
        return self.path_for(epochs[-1]) if epochs else None


class BackgroundWriter:
    """Writes epoch checkpoints on a thread of its own, one at a time, while training goes on."""

    def __init__(self, store: CheckpointStore):
        self.store = store
        self.last: str | None = None  # the newest whole file
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="gpuflow-checkpoint")
        self._writing: Future | None = None

    def submit(self, payload: dict, epoch: int, retain: tuple, then: Callable[[], None]) -> None:
        """Once the previous file is whole: write `payload`, CheckpointStore.retain(*retain), then `then()`."""
        self.wait()  # the previous file is whole (and its error, if any, raised) first
        self._writing = self._pool.submit(self._write, payload, epoch, retain, then)

    def _write(self, payload: dict, epoch: int, retain: tuple, then: Callable[[], None]) -> None:
        self.last = str(self.store.save(payload, epoch))
        self.store.retain(*retain)
        then()

    def wait(self) -> None:
        """Until the file being written is whole; raises what its write raised (a full disk)."""
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.result()
