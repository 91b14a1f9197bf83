"""A run's watcher: a small process that ends the flow's MLflow run KILLED as soon as the flow dies without ending
it (kill -9, the OOM killer), not at the next run on the host (orphans.py, still the fallback: a host crash takes
the watcher too).

    python -m gpuflow.tasks.tracking.watcher    (its stdin: the read end of a pipe that only the flow can write)

The flow writes one JSON line, the run's id and store (never in argv: `ps` shows argv to every account), and
`ended` once it has ended the run. End of file without `ended` means the kernel closed a dead flow's end of the
pipe. Until then the watcher holds the pipe and nothing else: stdlib only, no MLflow, no torch. Home-made because
no library watches a process from outside it; a pipe's end of file is the kernel's own notice of a death, and,
unlike PR_SET_PDEATHSIG, comes when the whole process dies, not the thread that started the watcher.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
from typing import Iterator

ENDED = b"ended"
POLL_S = 1.0  # how often it also checks that the flow is still its parent (a fork could keep the pipe open)
DEADLINE_S = 30  # from the flow's death to the watcher's exit, whatever the store does (a busy host imports slowly)
RELEASE_WAIT_S = 5.0  # how long the flow waits for its watcher to leave once told the run ended


class RunWatcher:
    """The flow's side: the pipe's write end and the watcher's process (None: no watcher could start)."""

    def __init__(self, fd: int | None = None, proc: subprocess.Popen | None = None):
        self.fd, self.proc = fd, proc

    def release(self) -> None:
        """The run is ended (or its end was tried): the watcher leaves without looking at it."""
        if self.fd is None:
            return
        try:
            os.write(self.fd, ENDED + b"\n")
        except OSError:  # the watcher is gone already (stopped with a served worker): nothing to tell
            pass
        finally:
            os.close(self.fd)
            self.fd = None
        try:
            self.proc.wait(RELEASE_WAIT_S)  # collected here, not left a zombie of a long-lived flow process
        except subprocess.TimeoutExpired:  # not expected: it exits on reading the line
            pass


def watch_run(uri: str, run_id: str) -> RunWatcher:
    """Start the watcher of `run_id` in store `uri`, which ends the run KILLED if this process dies before
    `release()`; never raises (without a watcher the next run on this host still reaps the run)."""
    from gpuflow.training.uris import absolute_uri

    job = json.dumps({"run_id": run_id, "uri": absolute_uri(uri), "owner": os.getpid()}).encode()
    read, write = os.pipe()  # neither end is inheritable: only the watcher's stdin gets the read end
    try:
        os.write(write, job + b"\n")  # in the pipe before the watcher starts: a flow killed now still leaves it
        # its own session: a terminal's Ctrl-C or a signal to the flow's group must not take the watcher too
        proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=read, stdout=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError as e:
        os.close(write)
        logging.getLogger(__name__).warning("run %s has no watcher (%s): if this process is killed, the run is "
                                            "marked KILLED only by the next gpuflow run on this host", run_id, e)
        return RunWatcher()
    finally:
        os.close(read)
    return RunWatcher(write, proc)


def owner_lines(fd: int) -> Iterator[bytes]:
    """The flow's complete lines on `fd`, until end of file or until this process has another parent."""
    parent, pending = os.getppid(), b""
    while os.getppid() == parent:
        if not select.select([fd], [], [], POLL_S)[0]:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            return
        *lines, pending = (pending + chunk).split(b"\n")
        yield from lines


def owner_ended(lines: Iterator[bytes]) -> bool:
    """Whether the flow said it ended the run before its end of the pipe closed."""
    return any(line == ENDED for line in lines)


def end_killed(job: dict) -> str | None:
    """End the run KILLED if it is still RUNNING: None once it did, else the status the run had."""
    from .orphans import end_orphaned_run  # MLflow, imported only now that the flow is dead
    from .store import checkpoint_wal, open_store

    client = open_store(job["uri"])
    run = client.get_run(job["run_id"])
    if run.info.status != "RUNNING":
        return run.info.status
    end_orphaned_run(client, run, f"its watcher (pid {os.getpid()}) as soon as the owner died")
    checkpoint_wal(job["uri"])
    return None


def not_marked(job: dict, why: str) -> int:
    """Say in one line that the run stays RUNNING, and why; the exit code."""
    print(f"gpuflow: the flow (pid {job['owner']}) died without ending MLflow run {job['run_id']}, which could not "
          f"be marked KILLED ({why}); the next gpuflow run on this host will", file=sys.stderr, flush=True)
    return 1


def report_killed(job: dict) -> int:
    """End the dead flow's run KILLED, or say why not, within DEADLINE_S; the exit code."""
    # exits from inside whatever call is waiting (a library may retry on any exception it sees)
    signal.signal(signal.SIGALRM, lambda *_: os._exit(not_marked(job, f"no answer from the store in {DEADLINE_S} s")))
    signal.alarm(DEADLINE_S)
    try:
        found = end_killed(job)
    except Exception as e:  # noqa: BLE001 - said in one line: the next run on this host still reaps it
        return not_marked(job, f"{type(e).__name__}: {e}")
    if found is None:
        print(f"gpuflow: the flow (pid {job['owner']}) died without ending MLflow run {job['run_id']}; "
              "marked it KILLED", file=sys.stderr, flush=True)
    return 0


def main() -> int:
    lines = owner_lines(sys.stdin.fileno())
    first = next(lines, None)
    if first is None:  # the flow died before it wrote (not expected: the line is written before the watcher starts)
        return 0
    job = json.loads(first)
    if owner_ended(lines):
        return 0
    from gpuflow.training.lifetime import leave

    leave(report_killed(job))  # without MLflow's teardown, which only keeps the watcher alive longer


if __name__ == "__main__":
    sys.exit(main())
