"""Device assignment: a request plus an EnvironmentReport gives a DevicePlan, or a clear error.

Users name physical GPUs (nvidia-smi numbering, PCI bus order). The child process gets
CUDA_DEVICE_ORDER=PCI_BUS_ID and CUDA_VISIBLE_DEVICES in the requested order, so inside it
the logical ids are always 0..n-1 and logical 0 is the primary card. Nothing here touches CUDA.
"""

from __future__ import annotations

import fcntl
import logging
import os
import pwd
import socket
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Literal, Protocol

from prefect import task
from prefect.concurrency.sync import concurrency
from pydantic import BaseModel

from gpuflow.training.errors import UserError

from .probe import EnvironmentReport, GpuInfo


class AssignmentError(UserError):
    """The request cannot be met on this host; the message names the value and the fix."""


GPUS_HELP = ("auto (all free GPUs, else CPU), cpu, a count like '2', or physical ids in order "
             "like '3,2,0,1' (the first is the primary card; '3,' is GPU 3 alone)")


def parse_gpus(v: str) -> str:
    """The `gpus` grammar, checked (the parameter is declared in gpuflow.flows.params)."""
    v = str(v).strip().replace(" ", "")
    if v == "0":
        raise ValueError("gpus=0 asks for no GPU; use gpus=cpu to train on the CPU")
    if v in ("auto", "cpu") or v.isdigit():
        return v
    parts = [p for p in v.split(",") if p]  # '3,' names physical GPU 3 alone
    if not parts or not all(p.isdigit() for p in parts):
        raise ValueError(f"gpus={v!r} is not understood; use auto, cpu, a count like 2, or physical ids like 3,2")
    dup = sorted({p for p in parts if parts.count(p) > 1})
    if dup:
        raise ValueError(f"gpus={v!r} names GPU {', '.join(dup)} twice; list each card once")
    return v


def explicit_ids(gpus: str) -> list[int] | None:
    return [int(p) for p in gpus.split(",") if p] if "," in gpus else None


class DeviceRequest(Protocol):
    """What assignment reads from the validated parameters (gpuflow.flows.params)."""

    gpus: str
    strategy: str
    backend: str
    min_free_mb: int
    skip_busy: bool
    cpu_processes: int


class DevicePlan(BaseModel):
    strategy: Literal["single", "dp", "ddp"]
    backend: Literal["nccl", "gloo"]
    device: Literal["cpu", "cuda"]
    nproc_per_node: int
    physical_ids: list[int] = []
    uuids: list[str] = []
    logical_ids: list[int] = []
    physical_to_logical: dict[int, int] = {}
    primary: int | None = None
    env: dict[str, str] = {}
    warnings: list[str] = []

    def child_environ(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment a child must start with: base plus the plan's device variables."""
        env = dict(os.environ if base is None else base)
        env.update(self.env)
        return env

    def describe(self) -> str:
        if self.device == "cpu":
            return f"cpu x{self.nproc_per_node}"
        return "gpu " + ",".join(map(str, self.physical_ids))


def _cpu_plan(report: EnvironmentReport, req: DeviceRequest) -> DevicePlan:
    if req.strategy == "dp":
        raise AssignmentError("strategy 'dp' (nn.DataParallel) needs GPUs and this host has none "
                              "usable; use strategy 'ddp' (gloo) or 'single' on CPU")
    if req.backend == "nccl":
        raise AssignmentError("backend 'nccl' needs GPUs and this host has none usable; use 'gloo'")
    nproc = req.cpu_processes or (2 if report.cpu_count >= 2 else 1)
    strategy = req.strategy if req.strategy != "auto" else ("ddp" if nproc > 1 else "single")
    if strategy == "single":
        nproc = 1
    return DevicePlan(strategy=strategy, backend="gloo", device="cpu", nproc_per_node=nproc,
                      env={"CUDA_VISIBLE_DEVICES": ""})


def _why_not(g: GpuInfo, req: DeviceRequest, locked: set[int]) -> str | None:
    if g.index in locked:
        return "in use by another gpuflow run"
    if req.skip_busy and g.processes:
        return f"busy ({g.processes} other processes)"
    if g.memory_free_mb < req.min_free_mb:
        return f"{g.memory_free_mb} MiB free < min_free_mb {req.min_free_mb}"
    return None


def _choose(report: EnvironmentReport, req: DeviceRequest, locked: set[int]) -> list[GpuInfo]:
    by_id = {g.index: g for g in report.gpus}
    visible = report.visible_physical_ids()
    ids = explicit_ids(req.gpus)
    if ids is not None:
        return [_check_explicit(i, by_id, visible, report, req, locked) for i in ids]
    pool = [by_id[i] for i in visible]
    free = [g for g in pool if _why_not(g, req, locked) is None]
    free.sort(key=lambda g: (-g.memory_free_mb, g.index))  # most free memory first
    want = len(free) if req.gpus == "auto" else int(req.gpus)
    if want > len(pool):
        raise AssignmentError(
            f"gpus={req.gpus} asks for {want} GPUs but this process can use {len(pool)} "
            f"(physical {', '.join(map(str, visible)) or 'none'}); ask for at most {len(pool)}")
    if want == 0 or len(free) < want:
        reasons = "; ".join(f"GPU {g.index}: {_why_not(g, req, locked)}" for g in pool if g not in free)
        raise AssignmentError(
            f"gpus={req.gpus} needs {want or 'at least one'} free GPU(s) but only {len(free)} "
            f"are free ({reasons}); wait, lower min_free_mb, set skip_busy=false, or use gpus=cpu")
    return free[:want]


def _check_explicit(i: int, by_id: dict, visible: list[int], report: EnvironmentReport,
                    req: DeviceRequest, locked: set[int]) -> GpuInfo:
    if i not in by_id:
        present = ", ".join(map(str, sorted(by_id))) or "none"
        raise AssignmentError(f"physical GPU {i} does not exist on {report.hostname}; "
                              f"present: {present} (nvidia-smi numbering)")
    if i not in visible:
        raise AssignmentError(
            f"physical GPU {i} is hidden by the inherited CUDA_VISIBLE_DEVICES="
            f"{report.cuda_visible_devices!r}; usable here: {', '.join(map(str, visible)) or 'none'}. "
            "Pick one of those or unset CUDA_VISIBLE_DEVICES before starting gpuflow")
    g = by_id[i]
    if i in locked:
        raise AssignmentError(f"physical GPU {i} is in use by another gpuflow run; wait for it "
                              "or pick another card")
    if g.memory_free_mb < req.min_free_mb:
        raise AssignmentError(f"physical GPU {i} has {g.memory_free_mb} MiB free, below "
                              f"min_free_mb={req.min_free_mb}; pick another card or lower it")
    return g


def assign_devices_for(report: EnvironmentReport, req: DeviceRequest, batch_size: int,
                       precision: str = "fp32", locked: set[int] = frozenset()) -> DevicePlan:
    """Pure assignment: validate everything that can be checked before launch."""
    no_gpu = not report.visible_physical_ids()
    if req.gpus == "cpu" or (req.gpus == "auto" and no_gpu):
        plan = _cpu_plan(report, req)
    else:
        if no_gpu:
            raise AssignmentError(
                f"gpus={req.gpus} asks for GPUs but none are usable on {report.hostname} "
                f"(present: {', '.join(str(g.index) for g in report.gpus) or 'none'}, "
                f"CUDA_VISIBLE_DEVICES={report.cuda_visible_devices or 'unset'}); use gpus=cpu")
        plan = _gpu_plan(report, req, _choose(report, req, set(locked)))
    _check_batch_and_precision(plan, report, batch_size, precision)
    return plan


def _gpu_plan(report: EnvironmentReport, req: DeviceRequest, cards: list[GpuInfo]) -> DevicePlan:
    n = len(cards)
    strategy = req.strategy if req.strategy != "auto" else ("single" if n == 1 else "ddp")
    if strategy == "single" and n > 1:
        raise AssignmentError(f"strategy 'single' uses one GPU but gpus={req.gpus} gives {n}; "
                              "use strategy dp or ddp, or ask for one card")
    ids = [g.index for g in cards]
    warnings = [f"GPU {g.index} already runs {g.processes} other process(es)" for g in cards if g.processes]
    return DevicePlan(
        strategy=strategy, backend="gloo" if req.backend == "gloo" else "nccl", device="cuda",
        nproc_per_node=n if strategy == "ddp" else 1, physical_ids=ids,
        uuids=[g.uuid for g in cards], logical_ids=list(range(n)),
        physical_to_logical={p: l for l, p in enumerate(ids)}, primary=ids[0],
        env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))},
        warnings=warnings,
    )


def _check_batch_and_precision(plan: DevicePlan, report: EnvironmentReport, batch: int,
                               precision: str) -> None:
    n = len(plan.physical_ids) if plan.device == "cuda" else plan.nproc_per_node
    if plan.strategy in ("dp", "ddp") and batch < n:
        raise AssignmentError(f"global batch_size {batch} is smaller than the {n} devices of this "
                              f"{plan.strategy} plan; use batch_size >= {n} or fewer devices")
    if plan.strategy == "ddp" and batch % plan.nproc_per_node:
        raise AssignmentError(f"global batch_size {batch} does not split evenly over "
                              f"{plan.nproc_per_node} processes; use a multiple of {plan.nproc_per_node}")
    if precision == "fp16" and plan.device == "cpu":
        raise AssignmentError("precision 'fp16' needs CUDA and this plan runs on CPU; use 'bf16' or 'fp32'")
    if precision == "bf16" and plan.device == "cuda":
        old = [g for g in report.gpus if g.index in plan.physical_ids and not g.bf16]
        if old:
            raise AssignmentError(f"precision 'bf16' needs compute capability >= 8.0 but GPU "
                                  f"{old[0].index} ({old[0].name}) has {old[0].compute_capability}; "
                                  "use 'fp16' or 'fp32'")


# --- one run per card at a time --------------------------------------------------------

RANKS_WAIT_S = 30.0  # how long a run waits for the processes of an ended run to leave a card
DEVICE_LIMIT = "gpuflow-devices-{host}"  # this host's device-holding served runs queue on it (flows/serve.py)
log = logging.getLogger(__name__)


class CardLockError(UserError):
    """A card lock file or its folder cannot be used by this user; the message says how to fix it."""


def lock_dir() -> Path:
    return Path(os.environ.get("GPUFLOW_LOCK_DIR", Path(tempfile.gettempdir()) / "gpuflow-locks"))


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _make_shared_dir(folder: Path) -> None:
    """Create the lock folder writable by every user (sticky: nobody removes another's file)."""
    try:
        folder.mkdir(parents=True)
    except FileExistsError:
        return
    except PermissionError:
        raise CardLockError(f"cannot create the card lock folder {folder}; set GPUFLOW_LOCK_DIR to a "
                            "folder every gpuflow user of this machine can write") from None
    os.chmod(folder, 0o1777)  # mkdir's mode is cut by the umask


def _open_shared(path: Path) -> int:
    """Open a lock file that every user of the machine can open too (created mode 0666)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        pass
    except PermissionError:
        st = path.parent.stat()
        raise CardLockError(f"cannot create {path}: the lock folder belongs to {_user(st.st_uid)} with mode "
                            f"{st.st_mode & 0o7777:o}; have its owner run `chmod 1777 {path.parent}`") from None
    else:
        os.fchmod(fd, 0o666)  # whatever this process's umask
        return fd
    try:  # no O_CREAT: with fs.protected_regular it is refused on another user's file in a sticky folder
        return os.open(path, os.O_RDWR)
    except PermissionError:
        st = path.stat()
        raise CardLockError(f"card lock file {path} belongs to {_user(st.st_uid)} with mode "
                            f"{st.st_mode & 0o777:o} and this user cannot open it; have its owner run "
                            f"`chmod 666 {path}` (or remove it)") from None


class CardLocks:
    """A card is held by its run's exclusive flock on `<uuid>.lock` (the flow, torchrun's agent)
    and by a shared flock on `<uuid>.ranks` from every process that uses it (each rank, an
    evaluation: training/cardlock.py). The kernel drops both when a holder exits, even on a crash."""

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
        _make_shared_dir(self.folder)
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
            os.write(fd, f"{os.getpid()} {_user(os.getuid())}\n".encode())  # who holds it, for a person looking
            self._fds.append(fd)
        return free

    def _users_gone(self, uuid: str, deadline: float) -> bool:
        """True once no process holds the card's shared `.ranks` lock (probed, not kept)."""
        fd = _open_shared(self.path(uuid, "ranks"))
        try:
            waited = False
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return True  # closing fd drops the probe at once
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        return False
                if not waited:
                    log.warning("card %s: waiting up to %.0f s for the processes of an ended gpuflow run "
                                "to exit", uuid, max(0.0, deadline - time.monotonic()))
                    waited = True
                time.sleep(0.1)
        finally:
            os.close(fd)

    def acquire(self, plan: DevicePlan) -> None:
        deadline = time.monotonic() + self.ranks_wait_s
        for uuid, pid in zip(plan.uuids, plan.physical_ids, strict=True):
            if not self.try_lock(uuid, deadline):
                self.release()
                raise AssignmentError(f"physical GPU {pid} was just taken by another gpuflow run; retry")

    @property
    def fds(self) -> tuple[int, ...]:
        """The held locks' descriptors: a child given them holds the cards until it exits too."""
        return tuple(self._fds)

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)  # closing the descriptor drops the flock
        self._fds.clear()


def rank_lock_files(plan: DevicePlan) -> list[Path]:
    """The `.ranks` files of the plan's cards, which each process using them holds (shared)."""
    return [CardLocks().path(uuid, "ranks") for uuid in plan.uuids]


@contextmanager
def card_locks(plan: DevicePlan):
    """Hold the plan's cards for the block (the kernel drops the locks if this process dies)."""
    locks = CardLocks()
    locks.acquire(plan)
    try:
        yield locks
    finally:
        locks.release()


@contextmanager
def device_slot():
    """One slot of this host's device limit for the block: served runs that use devices queue
    here. Without the limit (flows/serve.py creates it), as with a plain `gpuflow run`, this
    passes quietly (Prefect's own fallback warns on every run)."""
    name = DEVICE_LIMIT.format(host=socket.gethostname())
    with concurrency(name, occupy=1) if _limit_exists(name) else nullcontext():
        yield


def _limit_exists(name: str) -> bool:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
            return True
        except ObjectNotFound:
            return False


def one_device_plan(report: EnvironmentReport, gpus: str) -> DevicePlan:
    """One device for evaluation or inference, with `run`'s --gpus grammar.

    auto: the freest GPU, else the CPU; '1': the freest GPU; '3,': physical GPU 3; cpu.
    """
    if gpus == "auto":
        gpus = "1" if report.visible_physical_ids() else "cpu"
    ids = explicit_ids(gpus)
    if (ids is not None and len(ids) > 1) or (gpus.isdigit() and int(gpus) > 1):
        hint = f"; to name physical GPU {gpus}, write '{gpus},'" if gpus.isdigit() else ""
        raise AssignmentError(f"gpus={gpus} asks for several devices but this step uses one; "
                              f"name one card ('3,'), ask for '1', or use cpu{hint}")
    request = SimpleNamespace(gpus=gpus, strategy="single", backend="auto", min_free_mb=0, skip_busy=True,
                              cpu_processes=1)
    return assign_devices_for(report, request, batch_size=1, locked=CardLocks().held_elsewhere(report))


@task(name="assign-devices")
def assign_devices(report: EnvironmentReport, request: DeviceRequest, batch_size: int,
                   precision: str = "fp32") -> DevicePlan:
    """Turn a device request into a validated DevicePlan (cards locked by others are avoided)."""
    return assign_devices_for(report, request, batch_size, precision,
                              locked=CardLocks().held_elsewhere(report))
