"""A child process of the flow, run under the reaper: its output streamed to the flow's log line by line,
and stopped in order, with everything it started, when it ends, is stopped, or the flow goes."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

from gpuflow.training.files import disk_full
from gpuflow.training.reaper import grace_seconds, start_supervised

TAIL_LINES = 40
STOP_POLL_S = 0.05  # how soon a quiet child is stopped once `stop` is set
PROGRESS_EVERY_S = 2.0  # at most one progress line a child per this many seconds reaches the console...
PROGRESS_ALL_UP_TO = 10  # ...unless it has this many steps or fewer: each is shown
TRACEBACK = "Traceback (most recent call last):"
CHAINED = ("The above exception was", "During handling of the above exception")
RANK_PREFIX = re.compile(r"(\[rank\d+\]:\s?)?(.*)")  # torchrun's tag: each rank's traceback is followed apart
# torchrun's own account of a rank's failure: its "failed (exitcode ...)" log line and its ChildFailedError; the
# flow's last line says the same, so they stay in the log file only
TORCHRUN_FAILED = re.compile(r"[EWI]\d{4} .*\] failed \(exitcode: ")
CHILD_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"


class Tracebacks:
    """The tracebacks in a child's output, each shown on the console as one line: its exception and the file
    that holds it whole."""

    def __init__(self, where: Path):
        self.where = where
        self.state: dict[tuple, str] = {}  # per (stream, rank): "frames", "message" or "after" (a chained one)

    def console(self, line: str, stream: str = "stderr") -> str | None:
        """What the console shows for this line of output: the line, its traceback's summary, or None."""
        rank, body = RANK_PREFIX.fullmatch(line).groups()
        key = (stream, rank)
        state = self.state.pop(key, None)
        if body.startswith(TRACEBACK):
            self.state[key] = "frames"
            return None
        if state == "frames" and (not body or body[0].isspace() or body.startswith(CHAINED)):
            self.state[key] = state
            return None
        if state == "frames":  # the exception itself; a text ending in ':' goes on below (torchrun's summary)
            self.state[key] = "message" if body.rstrip().endswith(":") else "after"
            return None if body.startswith(CHILD_FAILED) else f"{line.rstrip()} (traceback in {self.where})"
        if state == "message" and body:
            self.state[key] = state
            return None
        if state in ("message", "after") and (not body or body.startswith(CHAINED)):  # a chained one may follow
            self.state[key] = "after"
            return None
        return None if TORCHRUN_FAILED.match(body) else line


class Progress:
    """A child's progress lines (those `pattern` matches: `<n>/<total>` in its groups 1 and 2) on the console at
    most every PROGRESS_EVERY_S, the first and the last always, each of a job of PROGRESS_ALL_UP_TO steps or
    fewer; the others reach the log file alone. A sweep of short epochs shows a few lines a trial, not one an
    epoch (each a Prefect API log record)."""

    def __init__(self, pattern: re.Pattern):
        self.pattern, self.shown_at = pattern, None

    def shown(self, line: str) -> bool:
        m = self.pattern.match(line)
        if m is None:
            return True
        now = time.monotonic()
        if (self.shown_at is None or m[1] == m[2] or int(m[2]) <= PROGRESS_ALL_UP_TO
                or now - self.shown_at >= PROGRESS_EVERY_S):
            self.shown_at = now
            return True
        return False


class Stopped(Exception):
    """The flow stopped the launch before it ended (a sweep's pruned trial, a stopped sweep)."""


def _pump(stream, name: str, q: queue.Queue) -> None:
    try:
        for line in iter(stream.readline, ""):
            q.put((name, line.rstrip("\n")))
        stream.close()
    finally:  # the stream's end, however reading it ended: run_child waits for both
        q.put((name, None))


def run_child(cmd: list[str], env: dict, cwd: Path, log: logging.Logger | logging.LoggerAdapter,
              hold_fds: tuple[int, ...] = (), log_file: Path | None = None,
              stop: threading.Event | None = None, progress: re.Pattern | None = None) -> tuple[int, list[str]]:
    """Run cmd under the reaper, each output line to `log` (and `log_file`); returns (exit code, last lines).

    With a `log_file`, a traceback reaches `log` as one line naming that file, and the lines `progress` matches
    are thinned out (Progress). Nothing the child started outlives it or this process; `hold_fds` (card locks)
    stay open until then. Setting `stop` stops it and raises Stopped."""
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    tracebacks = Tracebacks(log_file) if log_file is not None else None  # without a file, shown whole
    thinned = Progress(progress) if progress is not None and log_file is not None else None
    if log_file is not None:  # before the child starts: nothing may fail between its start and the `try`
        log_file.parent.mkdir(parents=True, exist_ok=True)
    out = open(log_file, "a") if log_file is not None else None
    q: queue.Queue = queue.Queue()
    # bytes that are not UTF-8 (a C library's message, a Latin-1 file name) are shown escaped, never end the reading
    try:
        proc = start_supervised(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                errors="backslashreplace", bufsize=1, start_new_session=True, pass_fds=hold_fds)
    except BaseException:
        if out is not None:
            out.close()
        raise
    try:
        for s, n in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
            threading.Thread(target=_pump, args=(s, n, q), daemon=True).start()
        open_streams = 2
        while open_streams:
            if stop is not None and stop.is_set():  # acted on when set, not when the output pauses
                _terminate(proc)
                raise Stopped()
            try:
                name, line = q.get(timeout=STOP_POLL_S)
            except queue.Empty:
                continue
            if line is None:
                open_streams -= 1
                continue
            tail.append(line)
            shown = tracebacks.console(line, name) if tracebacks else line
            if shown is None or (thinned is not None and not thinned.shown(shown)):
                log.debug(line)
            else:
                (log.warning if name == "stderr" and "error" in shown.lower() else log.info)(shown)
            if out is not None:
                _logged(out, log_file, line + "\n")
        return proc.wait(), list(tail)
    finally:
        if proc.poll() is None:  # cancelled or failed (a full disk too): take the whole group down
            _terminate(proc)
        if out is not None:
            _logged(out, log_file)


def _logged(out, log_file: Path, text: str | None = None) -> None:
    """Write `text` to the child's log file (None: close it); a full disk raises DiskFull naming that file, which
    stops the child: a run that cannot keep its log cannot keep its checkpoints either."""
    try:
        if text is None:
            out.close()
        else:
            out.write(text)
    except OSError as e:
        if (full := disk_full(e, log_file)) is None:
            raise
        if text is not None:
            with contextlib.suppress(OSError):
                out.close()  # its unwritten lines fail again: said once, by the DiskFull below
        raise full from None


def _terminate(proc: subprocess.Popen) -> None:
    """SIGTERM to the reaper, which stops everything below it within its grace period."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_seconds() + 30)
    except subprocess.TimeoutExpired:  # not expected: the reaper ends within its grace
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass
