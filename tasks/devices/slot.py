"""This host's device slot: a Prefect global concurrency limit, one slot per run, so a scheduled retrain and a
manual run never train at once. A holder keeps `<limit>.<lease>.slot` flocked in the card-lock folder: a waiting
run that finds it unlocked (its holder died) releases that lease at once.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import tempfile
import threading
import time
from contextlib import contextmanager
from contextvars import copy_context
from pathlib import Path
from uuid import UUID

from gpuflow.training.cardlock import CardLockError, open_lock_file

from .cards import lock_dir, make_shared_dir, user_name

DEVICE_LIMIT = "gpuflow-devices-{host}"  # this host's device-holding served runs queue on it (flows/serve.py)
SLOT_LEASE_S = 60.0  # the shortest lease Prefect's server grants: it bounds a dead holder no waiting run can see
SLOT_POLL_S = 2.0  # how often a waiting run asks for the slot again and looks for dead holders
RENEW_S = SLOT_LEASE_S / 3  # two renewals may fail before the lease lapses
log = logging.getLogger(__name__)


@contextmanager
def device_slot():
    """Hold one slot of this host's device limit for the block; without the limit (a plain `gpuflow run`),
    pass quietly."""
    from prefect.client.orchestration import get_client

    name = DEVICE_LIMIT.format(host=socket.gethostname())
    if not limit_exists(name):
        yield
        return
    with get_client(sync_client=True) as client:
        lease = _take_slot(client, name)
        try:
            with _holder_file(name, lease), _renewed(lease):
                yield
        finally:
            client.release_concurrency_slots_with_lease(lease)


def _take_slot(client, name: str) -> UUID:
    """The lease of a slot of `name`, asked for every SLOT_POLL_S; dead holders' leases are released meanwhile."""
    from prefect.exceptions import PrefectHTTPStatusError

    told: list[str] | None = None
    while True:
        try:
            response = client.increment_concurrency_slots_with_lease(
                names=[name], slots=1, mode="concurrency", lease_duration=SLOT_LEASE_S, holder=_lease_holder())
            return UUID(response.json()["lease_id"])
        except PrefectHTTPStatusError as e:
            if e.response.status_code != 423:  # 423 Locked: every slot is taken
                raise
        holders, freed = _release_dead_holders(client, name)
        if freed:
            continue  # ask again at once
        if holders != told:
            _run_log().warning("waiting for this host's device slot (Prefect concurrency limit %s), held by %s",
                               name, "; ".join(holders) or f"a run with no holder file in {lock_dir()} (one whose "
                               f"GPUFLOW_LOCK_DIR or TMPDIR differs, or one killed as it gave the slot back: its "
                               f"lease lapses within {SLOT_LEASE_S:.0f} s)")
            told = holders
        time.sleep(SLOT_POLL_S)


def _lease_holder():
    """The flow run taking the slot, recorded with its lease in Prefect (None outside a flow run)."""
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder
    from prefect.runtime import flow_run

    run_id = flow_run.get_id()
    return ConcurrencyLeaseHolder(type="flow_run", id=run_id) if run_id else None


def _run_log() -> logging.Logger | logging.LoggerAdapter:
    """The flow run's logger, whose lines reach the Prefect UI too; else this module's."""
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except MissingContextError:
        return log


@contextmanager
def _holder_file(name: str, lease: UUID):
    """`<limit>.<lease>.slot` in the lock folder, flocked for the block: the kernel drops it if this process dies."""
    from prefect.runtime import flow_run

    folder = lock_dir()
    make_shared_dir(folder)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".slot-")
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.fchmod(fd, 0o644)  # other users' runs open it to probe the lock and read who holds the slot
    run = flow_run.get_name()
    os.write(fd, f"pid {os.getpid()} of {user_name(os.getuid())}{f', flow run {run!r}' if run else ''}".encode())
    path = folder / f"{name}.{lease}.slot"
    os.replace(tmp, path)  # appears already locked: no waiter ever sees it free while its holder lives
    try:
        yield
    finally:
        _remove(path)
        os.close(fd)


def _release_dead_holders(client, name: str) -> tuple[list[str], int]:
    """Release the lease of every holder file no living process locks; (who holds the others, how many freed)."""
    holders, freed = [], 0
    for path in sorted(lock_dir().glob(f"{name}.*.slot")):
        lease = _lease_of(path, name)
        if lease is None:
            continue  # a stray or planted name: nothing to release
        try:
            fd = open_lock_file(path, os.O_RDONLY)
        except (OSError, CardLockError):
            continue  # its holder just left, or it is no plain file (planted under that name)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holders.append(os.read(fd, 400).decode(errors="replace"))
            continue
        finally:
            os.close(fd)
        log.warning("device slot %s: its holder died (%s); releasing its lease", name, path.name)
        client.release_concurrency_slots_with_lease(lease)
        freed += _remove(path)
    return holders, freed


def _lease_of(path: Path, name: str) -> UUID | None:
    """The lease a holder file of `name` names (`<name>.<lease>.slot`), or None for any other name (a planted
    `<name>.x.<lease>.slot` must not release a living holder's lease)."""
    try:
        lease = UUID(path.name.removeprefix(f"{name}.").removesuffix(".slot"))
    except ValueError:
        return None
    return lease if path.name == f"{name}.{lease}.slot" else None


def _remove(path: Path) -> bool:
    """False if the file stays: another user's, in the sticky folder."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass  # another waiter released it first
    except PermissionError:
        log.debug("cannot remove %s", path)
        return False
    return True


@contextmanager
def _renewed(lease: UUID):
    """The lease renewed by a thread while the block runs, on the API that granted it: the thread runs in this
    context, whose settings may name an API that no environment variable does (`prefect_api()`'s, `gpuflow
    serve`'s); a thread of its own would find none and renew on a temporary server Prefect starts for it (#58: the
    lease lapsed after 60 s while the run trained)."""
    from prefect.client.orchestration import get_client

    stop = threading.Event()

    def renew() -> None:
        with get_client(sync_client=True) as client:
            while not stop.wait(RENEW_S):
                try:
                    client.renew_concurrency_lease(lease, SLOT_LEASE_S)
                except Exception as e:  # the run goes on; the slot may be given to another run meanwhile
                    log.warning("device slot lease %s not renewed: %s", lease, e)

    thread = threading.Thread(target=copy_context().run, args=(renew,), name="device-slot-lease", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def limit_exists(name: str) -> bool:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
            return True
        except ObjectNotFound:
            return False
