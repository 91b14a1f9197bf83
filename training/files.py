"""Writing files so that a reader never sees half of one: temp file in the same folder, rename."""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path
from typing import Callable

from .errors import DiskFull


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
        if (full := _disk_full(e)) is None:
            raise
        raise DiskFull(f"disk full: cannot write {str(path)!r} ({full.strerror}); free space on that disk, "
                       "or point data_root / runs_dir at another one") from None


def _disk_full(e: BaseException | None) -> OSError | None:
    """The ENOSPC/EDQUOT error in `e`'s chain (torch.save re-raises a failed write as a RuntimeError)."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
        e = e.__cause__ or e.__context__
    return None


def write_json_atomic(path: str | Path, obj) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2, default=str)))
