"""A child process of the flow, run under the reaper: its output streamed to the flow's log line by
line (two reader threads: a full pipe can never block it), and stopped in order, with everything
it started, when it ends, is stopped, or the flow goes."""

from __future__ import annotations

import collections
import logging
import os
import queue
import signal
import subprocess
import threading
from pathlib import Path

from gpuflow.training.reaper import grace_seconds, start_supervised

TAIL_LINES = 40



class Stopped(Exception):
    """The flow stopped the launch before it ended (a sweep's pruned trial, a stopped sweep)."""


def _pump(stream, name: str, q: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        q.put((name, line.rstrip("\n")))
    stream.close()
    q.put((name, None))


def run_child(cmd: list[str], env: dict, cwd: Path, log: logging.Logger | logging.LoggerAdapter,
              hold_fds: tuple[int, ...] = (), log_file: Path | None = None,
              stop: threading.Event | None = None) -> tuple[int, list[str]]:
    """Run cmd, forwarding each output line to `log` (and `log_file`) as it arrives; returns
    (its exit code, its last lines).

    The child runs under the reaper (training/reaper.py) in a session of its own: a Ctrl-C
    reaches this process, which stops it in order; when it ends, is stopped, or this process
    dies, nothing it started is left (SIGTERM, then SIGKILL after the grace period), whatever
    sessions its processes made and whatever signals they ignore; `hold_fds` (card locks)
    stay open until then. Setting `stop` stops it the same way and raises Stopped.
    """
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    proc = start_supervised(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, bufsize=1, start_new_session=True, pass_fds=hold_fds)
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
    out = open(log_file, "a") if log_file is not None else None
    q: queue.Queue = queue.Queue()
    readers = [threading.Thread(target=_pump, args=(s, n, q), daemon=True)
               for s, n in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
    for t in readers:
        t.start()
    try:
        open_streams = 2
        while open_streams:
            try:
                name, line = q.get(timeout=0.5)
            except queue.Empty:
                if stop is not None and stop.is_set():
                    _terminate(proc)
                    raise Stopped() from None
                continue
            if line is None:
                open_streams -= 1
                continue
            tail.append(line)
            (log.warning if name == "stderr" and "error" in line.lower() else log.info)(line)
            if out is not None:
                out.write(line + "\n")
        return proc.wait(), list(tail)
    finally:
        if proc.poll() is None:  # we are being cancelled or failed: take the whole group down
            _terminate(proc)
        if out is not None:
            out.close()


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
