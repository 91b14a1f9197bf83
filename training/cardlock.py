"""Every process that uses a card holds a shared flock on the `<uuid>.ranks` files GPUFLOW_CARD_LOCKS names until
it exits, so a new run never gets a card a process of an ended run still uses. Without the variable, nothing.
A file in the card-lock folder is only ever opened through `open_lock_file`, by either side."""

from __future__ import annotations

import errno
import fcntl
import os
import stat

import psutil

from .contract import CARD_LOCKS_ENV, CARD_OWNER_ENV
from .errors import UserError


class CardLockError(UserError):
    """A card lock file or its folder cannot be used by this user; the message says how to fix it."""


def open_lock_file(path: str | os.PathLike, flags: int) -> int:
    """os.open(path, flags) for a card lock file (made mode 0666 with O_CREAT), never through a symbolic link and never
    on a hard link, FIFO or device: such a file, planted by another account, raises CardLockError instead, so no run
    writes a file of its user's through the shared lock folder, nor blocks opening it."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    except OSError as e:
        # ELOOP: a symbolic link (O_NOFOLLOW); EISDIR: a folder opened for writing; ENXIO: a socket
        if e.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise
        raise _not_a_lock_file(path, os.lstat(path)) from None
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:  # a hard link to another file looks regular: its count tells
        return fd
    os.close(fd)
    raise _not_a_lock_file(path, st)


def _not_a_lock_file(path: str | os.PathLike, st: os.stat_result) -> CardLockError:
    kinds = {"l": "a symbolic link", "d": "a folder", "p": "a FIFO", "s": "a socket", "c": "a device", "b": "a device"}
    kind = kinds.get(stat.filemode(st.st_mode)[0], f"a hard link (one of {st.st_nlink} names of one file)")
    return CardLockError(f"card lock file {path} is {kind}, not a lock file gpuflow made (another account may have "
                         "planted it there); remove it, or set GPUFLOW_LOCK_DIR to a folder of your own")


def hold_card_locks(environ: dict | None = None) -> list[int]:
    """Take a shared flock on each file in GPUFLOW_CARD_LOCKS for this process's life; the descriptors (never
    closed: closing one would drop its lock)."""
    env = os.environ if environ is None else environ
    fds = []
    for path in filter(None, env.get(CARD_LOCKS_ENV, "").split(os.pathsep)):
        try:
            fd = open_lock_file(path, os.O_RDONLY)  # a shared flock needs no write access
        except FileNotFoundError:
            raise UserError(f"{CARD_LOCKS_ENV} names {path}, which does not exist; gpuflow sets it for the "
                            "processes it starts: unset it to run this by hand") from None
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a starting run probes the card, an instant
        fds.append(fd)
    if fds and (owner := env.get(CARD_OWNER_ENV)) and not psutil.pid_exists(int(owner)):
        # the run that held the cards ended while this process started: a new run may own them now
        raise SystemExit(f"the gpuflow run (pid {owner}) that holds this process's cards has ended; exiting")
    return fds
