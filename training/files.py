"""Writing files so that a reader never sees half of one: temp file in the same folder, rename."""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
import traceback
from pathlib import Path
from typing import Callable

from .errors import DiskFull

DISK_FULL_FIX = "free space on that disk, or point data_root / runs_dir at another one"


def atomic_write(path: str | Path, write: Callable[[Path], None], mode: int = 0o644) -> Path:
    """Call write(tmp) on a temp file beside `path`, fsync it, then rename it over `path`.

    On any failure the temp file is removed; a full disk (or quota) raises DiskFull naming `path`."""
    path, tmp = Path(path), None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        write(Path(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # mkstemp makes it 0600; others sharing the folder read it too
        os.replace(tmp, path)
        return path
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if (full := disk_full(e, path)) is None:
            raise
        raise full from None


def disk_full(e: BaseException, path: str | os.PathLike | None = None) -> DiskFull | None:
    """`e` as the one-line DiskFull when a full disk (or quota) caused it, naming `path`, else the file the error
    names, else where the write was; None when no full disk did."""
    if path is None and (said := next((c for c in _chain(e) if isinstance(c, DiskFull)), None)):
        return said
    if (full := _disk_full(e)) is None:
        return None
    if (path := path or full.filename) is not None:
        return DiskFull(f"disk full: cannot write {str(path)!r} ({full.strerror}); {DISK_FULL_FIX}")
    return DiskFull(f"disk full: a write{_written_at(full)} failed ({full.strerror}); {DISK_FULL_FIX}")


def _written_at(e: BaseException) -> str:
    """` at <file>, line <n>`: the innermost frame of `e`'s traceback (a write to an open file names no file)."""
    frames = traceback.extract_tb(e.__traceback__)
    return f" at {frames[-1].filename}, line {frames[-1].lineno}" if frames else ""


def _disk_full(e: BaseException | None) -> OSError | None:
    """The ENOSPC/EDQUOT error in `e`'s chain (torch.save re-raises a failed write as a RuntimeError)."""
    return next((c for c in _chain(e) if isinstance(c, OSError) and c.errno in (errno.ENOSPC, errno.EDQUOT)), None)


def _chain(e: BaseException | None):
    """`e`, then what it was raised from or while handling, and so on."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def write_json_atomic(path: str | Path, obj) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2, default=str)))


def only_mine(st: os.stat_result) -> bool:
    """Whether a file read back (by its fstat) is a plain file of this account that no other may change: what a
    private file gpuflow wrote (a policy, a template database) must still be when it is read."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022
