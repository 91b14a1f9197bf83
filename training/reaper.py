"""The supervisor between gpuflow and every process a run starts: nothing it started outlives it.

    python -m gpuflow.training.reaper [--grace S] -- torchrun ... train.py ...

A Linux child subreaper, since a user's ranks may escape their parent: when the command ends, or on a signal, or
when the flow dies, it stops everything left below it (SIGTERM, a grace period, SIGKILL) and exits last, with the
command's exit code, so the card locks it holds are free only when nothing of the run is left.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time

import psutil

from .contract import STOP_GRACE_ENV
from .lifetime import die_with_parent

PR_SET_CHILD_SUBREAPER = 36
DEFAULT_GRACE_S = 10.0
POLL_S = 0.05


def grace_seconds() -> float:
    return float(os.environ.get(STOP_GRACE_ENV, DEFAULT_GRACE_S))


def start_supervised(cmd: list[str], reap: bool = True, **popen) -> subprocess.Popen:
    """Start `cmd` under the reaper, which is sent SIGTERM if this process dies, however it dies.

    `reap=False` for a server that starts no process of its own: the signal then reaches it directly."""
    parent = os.getpid()
    reaper = [sys.executable, "-m", "gpuflow.training.reaper", f"--grace={grace_seconds()}", "--"]
    return subprocess.Popen([*reaper, *cmd] if reap else cmd,
                            preexec_fn=lambda: die_with_parent(signal.SIGTERM, parent), **popen)


def run_supervised(cmd: list[str], **popen) -> int:
    """Run a service in the foreground under the reaper: Ctrl-C, SIGTERM or this process's death stops it all."""
    proc = start_supervised(cmd, **popen)
    try:
        return proc.wait()
    except KeyboardInterrupt:  # the terminal's Ctrl-C reached the reaper too: it stops the service
        return proc.wait()


def stop_supervised(procs: list[subprocess.Popen], sig: int = signal.SIGTERM, grace_s: float = 30.0) -> None:
    """Stop each (a reaper stops its server and all it started), killed with all below it if it outlasts the grace
    (a reaper whose own grace, GPUFLOW_STOP_GRACE_S, is longer would otherwise leave its server to init)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    for p in procs:
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            below = _below(p.pid)
            p.kill()
            p.wait()
            for q in below:
                with contextlib.suppress(psutil.Error):
                    q.kill()


def _below(pid: int | None = None) -> list[psutil.Process]:
    """Every process below `pid` (default: this one); none once it is gone."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _signal_all(sig: int) -> None:
    for p in _below():
        with contextlib.suppress(psutil.Error):
            p.send_signal(sig)


class Reaper:
    """Runs one command and stops whatever is left below this process when it ends or is stopped."""

    def __init__(self, cmd: list[str], grace: float):
        self.cmd, self.grace = cmd, grace
        self.code: int | None = None
        self.stop_sent: float | None = None  # when SIGTERM went to what is left
        self.asked: int | None = None  # a signal this process got

    def _on_signal(self, signum, frame) -> None:
        self.asked = signum

    def run(self) -> int:
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        # descriptors it inherited (card locks) go on to the command; Python's own are not inheritable
        child = subprocess.Popen(self.cmd, close_fds=False)
        while True:
            self._reap(child.pid)
            if self.asked is not None and self.stop_sent is None:
                self._stop(child.pid)
            if self.stop_sent is not None and time.monotonic() - self.stop_sent > self.grace:
                _signal_all(signal.SIGKILL)
            if self.code is not None and not _below():
                return self.code
            time.sleep(POLL_S)

    def _reap(self, main_pid: int) -> None:
        """Collect every exited child (the command, and orphans re-parented here)."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == main_pid:
                code = os.waitstatus_to_exitcode(status)
                self.code = code if code >= 0 else 128 - code
                if self.stop_sent is None and _below():  # it ended and left processes behind
                    self._stop(None)

    def _stop(self, main_pid: int | None) -> None:
        """SIGTERM: to the command (torchrun then stops its ranks in order) and to all the rest."""
        self.stop_sent = time.monotonic()
        if main_pid is not None and self.code is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(main_pid, self.asked or signal.SIGTERM)
        _signal_all(signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpuflow.training.reaper", description=__doc__.splitlines()[0])
    p.add_argument("--grace", type=float, default=grace_seconds(), help="seconds from SIGTERM to SIGKILL")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command")
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("no command given after --")
    return Reaper(cmd, args.grace).run()


if __name__ == "__main__":
    sys.exit(main())
