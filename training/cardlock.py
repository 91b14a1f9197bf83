"""Every process that uses a card holds a shared flock on the `<uuid>.ranks` files GPUFLOW_CARD_LOCKS names until
it exits, so a new run never gets a card a process of an ended run still uses. Without the variable, nothing."""

from __future__ import annotations

import fcntl
import os

import psutil

from .contract import CARD_LOCKS_ENV, CARD_OWNER_ENV
from .errors import UserError


def hold_card_locks(environ: dict | None = None) -> list[int]:
    """Take a shared flock on each file in GPUFLOW_CARD_LOCKS for this process's life; the descriptors (never
    closed: closing one would drop its lock)."""
    env = os.environ if environ is None else environ
    fds = []
    for path in filter(None, env.get(CARD_LOCKS_ENV, "").split(os.pathsep)):
        try:
            fd = os.open(path, os.O_RDONLY)  # a shared flock needs no write access
        except FileNotFoundError:
            raise UserError(f"{CARD_LOCKS_ENV} names {path}, which does not exist; gpuflow sets it for the "
                            "processes it starts: unset it to run this by hand") from None
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a starting run probes the card, an instant
        fds.append(fd)
    if fds and (owner := env.get(CARD_OWNER_ENV)) and not psutil.pid_exists(int(owner)):
        # the run that held the cards ended while this process started: a new run may own them now
        raise SystemExit(f"the gpuflow run (pid {owner}) that holds this process's cards has ended; exiting")
    return fds
