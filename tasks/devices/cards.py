"""One run per card at a time: a card is free only when no process of an earlier run is left on it.

The lock files and their folder are shared by every unix user of the machine (modes 0666 and 1777).
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import pwd
import stat
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from gpuflow.training.cardlock import CardLockError, open_lock_file

if TYPE_CHECKING:  # assign.py imports this module
    from .assign import DevicePlan
    from .probe import EnvironmentReport

RANKS_WAIT_S = 30.0  # how long a run waits for the processes of an ended run to leave a card
PROBE_HOLD_S = 2.0  # how long a card may be held by another run's look at which cards are free
log = logging.getLogger(__name__)


def lock_dir() -> Path:
    return Path(os.environ.get("GPUFLOW_LOCK_DIR", Path(tempfile.gettempdir()) / "gpuflow-locks"))


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def make_shared_dir(folder: Path) -> None:
    """Create the lock folder writable by every user (sticky: nobody removes another's file); an existing one must be
    a folder (not a link) of root's or this user's that no other account can swap files in, else CardLockError."""
    try:
        folder.mkdir(parents=True)
    except FileExistsError:
        _check_lock_folder(folder)
        return
    except PermissionError:
        raise CardLockError(f"cannot create the card lock folder {folder}; set GPUFLOW_LOCK_DIR to a "
                            "folder every gpuflow user of this machine can write") from None
    os.chmod(folder, 0o1777)  # mkdir's mode is cut by the umask


def _check_lock_folder(folder: Path) -> None:
    """Refuse a folder in which another account could plant or swap this run's lock files (as links to its files)."""
    st = folder.lstat()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        why = "is a symbolic link" if stat.S_ISLNK(st.st_mode) else "is not a folder"
    elif st.st_uid not in (0, os.geteuid()):
        why = "belongs to another account"
    elif st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        why = "is writable by other accounts without the sticky bit"
    else:
        return
    raise CardLockError(f"the card lock folder {folder} {why} (owner {user_name(st.st_uid)}, mode "
                        f"{st.st_mode & 0o7777:o}), so another account could make this run overwrite a file; remove "
                        "it (a folder root makes, mode 1777, is shared safely), or set GPUFLOW_LOCK_DIR to a folder "
                        "of your own")


def _open_shared(path: Path) -> int:
    """Open a lock file that every user of the machine can open too (created mode 0666)."""
    try:
        fd = open_lock_file(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        pass
    except PermissionError:
        st = path.parent.stat()
        raise CardLockError(f"cannot create {path}: the lock folder belongs to {user_name(st.st_uid)} with mode "
                            f"{st.st_mode & 0o7777:o}; have its owner run `chmod 1777 {path.parent}`") from None
    else:
        os.fchmod(fd, 0o666)  # whatever this process's umask
        return fd
    try:  # no O_CREAT: with fs.protected_regular it is refused on another user's file in a sticky folder
        return open_lock_file(path, os.O_RDWR)
    except PermissionError:
        st = path.lstat()
        raise CardLockError(f"card lock file {path} belongs to {user_name(st.st_uid)} with mode "
                            f"{st.st_mode & 0o777:o} and this user cannot open it; have its owner run "
                            f"`chmod 666 {path}` (or remove it)") from None


class CardLocks:
    """A card is held by its run's exclusive flock on `<uuid>.lock` and a shared flock on `<uuid>.ranks` from every
    process using it (training/cardlock.py); the kernel drops both when a holder exits, even on a crash."""

    def __init__(self, folder: Path | None = None, ranks_wait_s: float = RANKS_WAIT_S):
        self.folder = folder or lock_dir()
        self.ranks_wait_s = ranks_wait_s
        self._fds: list[int] = []

    def path(self, uuid: str, kind: str = "lock") -> Path:
        return self.folder / f"{uuid.replace('/', '_')}.{kind}"

    def held_elsewhere(self, report: EnvironmentReport) -> set[int]:
        """Physical ids another run holds right now, or whose ended run's processes outlive the wait."""
        deadline = time.monotonic() + self.ranks_wait_s  # one wait for all cards: they drain together
        out = set()
        for g in report.gpus:
            if self.try_lock(g.uuid, deadline):
                self.release()
            else:
                out.add(g.index)
        return out

    def try_lock(self, uuid: str, deadline: float | None = None) -> bool:
        """Take the card unless another run holds it; first wait (until `deadline`, by default
        ranks_wait_s from now) for processes of an ended run that still use it."""
        make_shared_dir(self.folder)
        fd = _open_shared(self.path(uuid))
        free = False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            free = self._users_gone(uuid, time.monotonic() + self.ranks_wait_s if deadline is None else deadline)
        except BlockingIOError:
            pass  # another run holds it
        finally:
            if not free:
                os.close(fd)
        if free:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()} {user_name(os.getuid())}\n".encode())  # who holds it, for a person looking
            self._fds.append(fd)
        return free

    def _users_gone(self, uuid: str, deadline: float) -> bool:
        """True once no process holds the card's shared `.ranks` lock (probed, not kept)."""
        fd = _open_shared(self.path(uuid, "ranks"))
        try:
            for attempt in itertools.count():
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return True  # closing fd drops the probe at once
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        return False
                if attempt == 0:
                    log.warning("card %s: waiting up to %.0f s for the processes of an ended gpuflow run "
                                "to exit", uuid, max(0.0, deadline - time.monotonic()))
                time.sleep(0.1)
        finally:
            os.close(fd)

    def acquire(self, plan: DevicePlan) -> None:
        deadline = time.monotonic() + self.ranks_wait_s
        for uuid, pid in zip(plan.uuids, plan.physical_ids, strict=True):
            looked_at = time.monotonic() + PROBE_HOLD_S  # another run's held_elsewhere holds a card that briefly
            while not self.try_lock(uuid, deadline):
                if time.monotonic() > looked_at:
                    self.release()
                    raise CardLockError(f"physical GPU {pid} was just taken by another gpuflow run; retry")
                time.sleep(0.05)

    @property
    def fds(self) -> tuple[int, ...]:
        """The held locks' descriptors: a child given them holds the cards until it exits too."""
        return tuple(self._fds)

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)  # closing the descriptor drops the flock
        self._fds.clear()


@contextmanager
def card_locks(plan: DevicePlan):
    """Hold the plan's cards for the block (the kernel drops the locks if this process dies)."""
    locks = CardLocks()
    locks.acquire(plan)
    try:
        yield locks
    finally:
        locks.release()
