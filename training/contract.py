"""What the flow and the ranks agree on across the process boundary (torch-free): variables, the run folder, and
the structured error a failing rank leaves in `<GPUFLOW_ERROR_DIR>/attempt-<n>/rank-<r>.json`. A *deterministic*
error (bad input, a full disk, or no progress since the attempt started) is not run again by a restarted rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from .errors import DiskFull
from .files import disk_full, write_json_atomic

# --- what the flow tells its children, by environment variable ----------------------------
ERROR_DIR_ENV = "GPUFLOW_ERROR_DIR"  # where a failing rank leaves its error (write_error)
OUTPUT_DIR_ENV = "GPUFLOW_OUTPUT_DIR"  # a user script's output folder, logged as artifacts (helper.py)
METRICS_FILE_ENV = "GPUFLOW_METRICS_FILE"  # the JSON lines rank 0 appends, relayed to MLflow (metrics.py)
CARD_LOCKS_ENV = "GPUFLOW_CARD_LOCKS"  # the card-lock files every process started takes a shared lock on
CARD_OWNER_ENV = "GPUFLOW_CARD_OWNER"  # pid of the flow holding the cards' run locks
LAUNCH_ATTEMPT_ENV = "GPUFLOW_LAUNCH_ATTEMPT"  # a Prefect retry of the launch is a restart for the worker
STOP_GRACE_ENV = "GPUFLOW_STOP_GRACE_S"  # seconds between SIGTERM and SIGKILL when a run stops (reaper.py)
FAULT_ENV = "GPUFLOW_FAULT"  # tests only: kill a rank at a chosen point (faults.py)
DIST_TIMEOUT_ENV = "GPUFLOW_DIST_TIMEOUT_S"  # a user script's default collective timeout (runscript.py)
PROCESS_GROUP_FILE_ENV = "GPUFLOW_PROCESS_GROUP_FILE"  # where rank 0 records whether the script joined one
NODE_ADDR_ENV = "GPUFLOW_NODE_ADDR"  # a machine's address for the other nodes of a placed run (flows/nodes.py)
NODE_DIR_ENV = "GPUFLOW_NODE_DIR"  # the folder `gpuflow node` serves from: its placed runs run there
PROCESS_GROUP_FILE = "process_group.json"  # its name in the run folder
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".safetensors")  # files a script saves its weights in


def main_line(msg: str) -> str:
    """One of the worker's own console lines: printed by rank 0 alone, with its prefix."""
    return f"[rank 0] {msg}"


def epoch_line(epoch: int, epochs: int, detail: str) -> str:
    """The worker's console line for an epoch; the flow knows it by EPOCH_LINE."""
    return main_line(f"epoch {epoch}/{epochs} {detail}")


EPOCH_LINE = re.compile(re.escape(main_line("epoch ")) + r"(\d+)/(\d+) ")


class RunFolder:
    """A run's folder and every file and folder the flow and its children write there."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    @classmethod
    def of(cls, runs_dir: str | os.PathLike, run_id: str, node: str | None = None) -> "RunFolder":
        """`<runs_dir>/<run id>`, or `<run id>-<node>` on a node of a placed run."""
        return cls(Path(runs_dir).resolve() / (f"{run_id}-{node}" if node else run_id))

    config = property(lambda self: self.root / "config.json")  # the worker's TrainConfig (flow)
    result = property(lambda self: self.root / "result.json")  # the worker's outcome (rank 0)
    metrics = property(lambda self: self.root / "metrics.jsonl")  # per-epoch lines, relayed live (rank 0)
    outputs = property(lambda self: self.root / "outputs")  # a user script's files (GPUFLOW_OUTPUT_DIR)
    logs = property(lambda self: self.root / "logs")  # the children's output, logged with the run
    torchrun = property(lambda self: self.root / "torchrun")  # torchrun's own folder (else one in /tmp per launch)
    errors = property(lambda self: self.root / "errors")  # attempt-N/rank-R.json of failing ranks
    process_group = property(lambda self: self.root / PROCESS_GROUP_FILE)  # did a script's rank 0 join one
    checkpoints = property(lambda self: self.root / "checkpoints")  # the worker's epoch-N.pt (config.checkpoint_dir)
    weights = property(lambda self: self.root / "weights.pt")  # the trained state dict alone, registered
    script_checkpoint = property(lambda self: self.root / "checkpoint")  # a script's, de-prefixed by the flow
    work = property(lambda self: self.root / "work")  # a script's sweep trial runs here: its files its own


_OURS = (str(Path(__file__).resolve().parent), str(Path(os.__file__).resolve().parent))  # gpuflow's and the stdlib


def whole_lines() -> None:
    """One write per line on stdout and stderr, so lines of ranks sharing a pipe or file never merge or split."""
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=False)


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job, as torchrun's environment says (the one reader of it)."""

    rank: int
    local_rank: int
    world_size: int
    restarts: int
    under_torchrun: bool
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def ranks() -> Ranks:
    env = os.environ
    return Ranks(int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("WORLD_SIZE", 1)),
                 int(env.get("TORCHELASTIC_RESTART_COUNT", 0)), "RANK" in env and "WORLD_SIZE" in env,
                 int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", 1))))


def where(exc: BaseException) -> tuple[str | None, int | None]:
    """(file, line) where `exc` was raised: the innermost frame of the user's code, else the innermost one."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return exc.filename, exc.lineno
    frames = traceback.extract_tb(exc.__traceback__)
    users = [f for f in frames if not f.filename.startswith(_OURS) and "-packages" not in f.filename
             and not f.filename.startswith("<")]
    frame = (users or frames or [None])[-1]
    return (frame.filename, frame.lineno) if frame else (None, None)


def made_progress(since: float, *folders: str | os.PathLike | None, top_level: str | os.PathLike | None = None) -> bool:
    """Whether a file was written after `since` anywhere under `folders` (checkpoints, outputs) or a checkpoint
    file directly in `top_level` (a tutorial's snapshot.pt in the working folder; not the mlflow.db beside it)."""
    def newer(paths) -> bool:  # hidden files (locks, temp files of atomic writes) are not progress
        return any(not p.name.startswith(".") and p.is_file() and p.stat().st_mtime > since for p in paths)

    return (any(f and Path(f).is_dir() and newer(Path(f).rglob("*")) for f in folders)
            or bool(top_level and newer(p for p in Path(top_level).iterdir() if p.suffix in CHECKPOINT_SUFFIXES)))


def _between_ranks(exc: BaseException) -> bool:
    """A failure of the link between ranks: the cause is elsewhere, and may not come back on a restart."""
    text = f"{type(exc).__name__} {exc}"
    return any(k in text for k in ("DistBackendError", "DistNetworkError", "DistStoreError", "gloo", "NCCL",
                                   "Connection", "connection"))


def write_error(exc: BaseException, deterministic: bool, hint: str = "", located: bool = True) -> None:
    """Leave this rank's error for the flow, when it asked. `located`: name where it was raised (not for
    gpuflow's own refusals)."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder:
        return
    file, line = where(exc) if located else (None, None)
    if full := disk_full(exc):  # wherever it was (a checkpoint, the metrics, a log): a restart fills it again
        exc, deterministic = full, True
    else:
        deterministic = deterministic and not _between_ranks(exc)
    message = (str(exc).strip().splitlines() or [""])[-1 if isinstance(exc, SyntaxError) else 0][:2000]
    here = ranks()
    _write({"type": type(exc).__name__, "message": message + hint, "file": file, "line": line,
            "rank": here.rank, "attempt": here.restarts, "time": time.time(), "deterministic": deterministic}, folder)


def _attempt_dir(folder: str | os.PathLike, attempt: int) -> Path:
    """Where the ranks of one torchrun attempt leave their errors and `finished-<rank>` marks."""
    return Path(folder) / f"attempt-{attempt}"


def _write(record: dict, folder: str) -> None:
    path = _attempt_dir(folder, record["attempt"]) / f"rank-{record['rank']}.json"
    try:
        write_json_atomic(path, record)
    except DiskFull:  # the disk that failed the rank is often this one: the room start_attempt kept
        _write_reserved(path, json.dumps(record).encode())


RESERVED_BYTES = 16384  # room for one error record (its message is cut at 2000 characters)


def _reserved(path: Path) -> Path:
    return path.with_name(f".{path.name}.reserved")  # hidden: no reader takes it for a record, nor for progress


def _reserve(path: Path) -> None:
    """Keep the room for this rank's error record on the disk now, so that a full disk can still be reported."""
    try:
        fd = os.open(_reserved(path), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.posix_fallocate(fd, 0, RESERVED_BYTES)
        finally:
            os.close(fd)
    except OSError:  # no room even now: a failure is said on stderr alone
        with contextlib.suppress(OSError):
            _reserved(path).unlink(missing_ok=True)


def _write_reserved(path: Path, data: bytes) -> None:
    """The record written into its kept room and renamed into place: no new block is needed."""
    with contextlib.suppress(OSError):
        with open(_reserved(path), "r+b") as f:
            f.write(data)
            f.truncate()
            os.fsync(f.fileno())
        os.replace(_reserved(path), path)


def _records(folder: Path) -> list[dict]:
    found = []
    for f in folder.glob("rank-*.json"):
        with contextlib.suppress(OSError, ValueError):
            found.append(json.loads(f.read_text()))
    return sorted(found, key=lambda r: r["time"])  # the first to fail is the cause; the others follow it


def start_attempt() -> None:
    """At a rank's start: its attempt's folder, so the flow reads a failure from the attempt that ended the job
    even when it left nothing (a rank killed by a signal), never from one torchrun restarted after; and room kept
    for this rank's error record, so that a full disk is reported too."""
    if folder := os.environ.get(ERROR_DIR_ENV):
        attempt = _attempt_dir(folder, ranks().restarts)
        attempt.mkdir(parents=True, exist_ok=True)
        _reserve(attempt / f"rank-{ranks().rank}.json")


def replay_deterministic() -> dict | None:
    """In a restarted rank: the attempt before's deterministic error, recorded for this one too (the caller exits
    instead of running the code again); None otherwise."""
    folder, here = os.environ.get(ERROR_DIR_ENV), ranks()
    if not folder or here.restarts == 0:
        return None
    before = [r for r in _records(_attempt_dir(folder, here.restarts - 1)) if r["deterministic"]]
    if not before:
        return None
    _write(before[0] | {"rank": here.rank, "attempt": here.restarts}, folder)
    print(f"[rank {here.rank}] not run again: {describe(before[0])} (the attempt before failed the same way "
          "before any progress)", file=sys.stderr, flush=True)
    return before[0]


def write_finished() -> None:
    """For a restart: this rank's script ran to its end (gloo may still abort it at exit, pytorch#190489)."""
    if folder := os.environ.get(ERROR_DIR_ENV):
        out = _attempt_dir(folder, ranks().restarts) / f"finished-{ranks().rank}"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.touch()


def _all_finished(attempt: Path, world_size: int) -> bool:
    return len(list(attempt.glob("finished-*"))) >= world_size


def replay_finished() -> bool:
    """In a restarted rank of a one-machine job: whether every rank of the attempt before ran its script to the end,
    so that an exit abort, not the script, failed it (the caller exits 0: running it again would train twice)."""
    folder, here = os.environ.get(ERROR_DIR_ENV), ranks()
    if not folder or here.restarts == 0 or here.local_world_size != here.world_size:
        return False
    if not _all_finished(_attempt_dir(folder, here.restarts - 1), here.world_size):
        return False
    write_finished()
    print(f"[rank {here.rank}] not run again: every rank ran the script to its end in the attempt before, which "
          "failed as a process exited (gloo's exit abort, pytorch#190489)", file=sys.stderr, flush=True)
    return True


def _last_attempt(folder: str | os.PathLike) -> Path | None:
    """The folder of the last attempt that started (`start_attempt`), None before any."""
    attempts = sorted(Path(folder).glob("attempt-*"), key=lambda p: int(p.name.split("-")[1]))
    return attempts[-1] if attempts else None


def read_error(folder: str | os.PathLike) -> dict | None:
    """For the flow: the first error of the last attempt, or None (not an earlier attempt's: torchrun restarted
    after it, so it is not what ended the job)."""
    last = _last_attempt(folder)
    return next(iter(_records(last)), None) if last else None


def ran_to_the_end(folder: str | os.PathLike, world_size: int) -> bool:
    """For the flow, when torchrun failed: whether every rank on this machine (`world_size` of them) ran the script
    to the end in its last attempt, so a process's exit failed it (gloo's exit abort, pytorch#190489)."""
    last = _last_attempt(folder)
    return last is not None and _all_finished(last, world_size)


def describe(record: dict) -> str:
    """`Type: message (at file, line N; rank R)`: the cause, in one line."""
    at = f"at {record['file']}, line {record['line']}; " if record.get("file") else ""
    return f"{record['type']}: {record['message']} ({at}rank {record['rank']})"


def write_process_group(script: str, world_size: int, joined: bool) -> None:
    """Rank 0, at the script's end: whether it joined a process group (nothing when no flow asked)."""
    if path := os.environ.get(PROCESS_GROUP_FILE_ENV):
        Path(path).write_text(json.dumps({"script": script, "world_size": world_size, "joined": joined}))


def read_process_group(path: str | os.PathLike) -> dict | None:
    """For the flow: rank 0's record, or None when it left none (one process, or the script failed)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def not_distributed(script: str, world_size: int, stepping: bool = False) -> str:
    """One line: `script` ran (`stepping`: began to train) in processes that joined no group; and the fix."""
    what = (f"{script} began to train in {world_size} processes without a process group (an optimizer step "
            "outside one): each would train a full copy of the model and write the same files, so it was "
            "stopped" if stepping else
            f"{script} ran in {world_size} processes that never joined a process group: each trained a full copy "
            "of the model and wrote the same files")
    return (f"{what}; run it with --strategy single (one process), or make it distributed "
            "(torch.distributed.init_process_group, a DistributedSampler, DDP)")
