"""Every process that uses a card holds it until it exits, so a new run never gets a card that
a process of an ended run still uses (a rank finishing a collective, memory not yet freed).

The flow that holds a card's run lock names the card's `<uuid>.ranks` files in
GPUFLOW_CARD_LOCKS (os.pathsep-separated); each process it starts takes a shared flock on
them, which the kernel drops when the process exits, however it ends. Without the variable
(a worker started by hand or by a test) this does nothing.
"""

from __future__ import annotations

import fcntl
import os

from .contract import CARD_LOCKS_ENV, CARD_OWNER_ENV
from .errors import UserError

OWNER_ENV = CARD_OWNER_ENV


def hold_card_locks(environ: dict | None = None) -> list[int]:
    """Take a shared flock on each file named in GPUFLOW_CARD_LOCKS, for the life of this
    process; the open descriptors (never closed: closing one would drop its lock)."""
    names = (os.environ if environ is None else environ).get(CARD_LOCKS_ENV, "")
    fds = []
    for path in filter(None, names.split(os.pathsep)):
        try:
            fd = os.open(path, os.O_RDONLY)  # a shared flock needs no write access
        except FileNotFoundError:
            raise UserError(f"{CARD_LOCKS_ENV} names {path}, which does not exist; gpuflow sets it for the "
                            "processes it starts: unset it to run this by hand") from None
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a starting run probes the card, an instant
        fds.append(fd)
    owner = (os.environ if environ is None else environ).get(OWNER_ENV)
    if fds and owner and not _alive(int(owner)):
        # The run that held the cards ended while this process started (its parent gone before
        # it could ask to die with it): a new run may own the cards now, so touch nothing.
        raise SystemExit(f"the gpuflow run (pid {owner}) that holds this process's cards has ended; exiting")
    return fds


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
