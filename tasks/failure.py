"""A launch's failure in one line: the first rank's own exception, else the signal that killed it, else its
last line of output. The line is the exception's whole message, which Prefect puts in the run's state and
`--watch` shows: the output before it (torchrun's summary) was streamed to the run's log and is in its log file."""

from __future__ import annotations

import re
import shutil
import signal
from pathlib import Path

from gpuflow.training.contract import ERROR_DIR_ENV, RunFolder, describe, read_error
from gpuflow.training.errors import UserError
from gpuflow.training.files import disk_full


class TrainingFailed(RuntimeError):
    """The worker exited non-zero, in one line; `deterministic`: the ranks said running it again would fail the same
    way; `output`: its last lines of output."""

    def __init__(self, message: str, deterministic: bool = False, output: tuple[str, ...] = ()):
        super().__init__(message)
        self.deterministic, self.output = deterministic, output


def would_repeat(e: BaseException) -> bool:
    """Would running it again, here or on a spare machine, fail the same way: a refusal of bad input, a full disk,
    or a failure the ranks said was deterministic?"""
    return (isinstance(e, UserError) or disk_full(e) is not None
            or (isinstance(e, TrainingFailed) and e.deterministic))


def error_folder(workdir: Path) -> dict:
    """Where the ranks of this launch leave their errors (training/contract.py), emptied first."""
    folder = RunFolder(workdir).errors
    shutil.rmtree(folder, ignore_errors=True)
    return {ERROR_DIR_ENV: str(folder)}


def failure(what: str, code: int, workdir: Path, tail: list[str], log_name: str) -> TrainingFailed:
    """The failure, one line naming its cause; the last lines of output (all of them in the run's logs/`log_name`)
    go with it as `output`."""
    record = read_error(RunFolder(workdir).errors)
    last = next((line for line in reversed(tail) if line.strip()), "no output")
    cause = (describe(record) if record else killed(code, tail)
             or f"exited with code {code}; its last line: {last.strip()[:500]}")
    return TrainingFailed(f"{what} failed: {cause}".replace("\n", " "), output=tuple(tail[-15:]),
                          deterministic=bool(record and record["deterministic"]))


TORCHRUN_SIGNAL = re.compile(r"Signal \d+ \((SIG\w+)\) received by PID")  # torchrun's failure summary
TORCHRUN_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")


def killed(code: int, tail: list[str]) -> str | None:
    """The signal that ended the process (it left no error file), from the reaper's exit code or torchrun's
    failure summary; None if no signal did."""
    who, name, rank = "the process", None, None
    if code > 128 and code - 128 in {s.value for s in signal.Signals}:
        name = signal.Signals(code - 128).name
    for line in tail:  # torchrun lists the root cause (the first failure) last
        if m := TORCHRUN_RANK.match(line):
            rank = m.group(1)
        elif m := TORCHRUN_SIGNAL.search(line):
            who, name = (f"rank {rank}" if rank is not None else who), m.group(1)
    if not name:
        return None
    oom = ("; SIGKILL is also what the kernel's out-of-memory killer sends: see `dmesg` and the run's memory"
           if name == "SIGKILL" else "")
    return f"{who} was killed by {name}{oom}"
