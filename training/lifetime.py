"""How gpuflow's processes end: with their parent (PR_SET_PDEATHSIG, so a flow killed outright takes its
children with it), on SIGTERM as on any other exit (`finally` blocks and exit handlers run), and, once their
work is written, at once (`leave`)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> None:
    """Have the kernel send `sig` to this process when its parent exits (Linux; else nothing).

    `parent`: the pid the caller expects as parent; if it is already gone, `sig` comes now."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return
    if parent is not None and os.getppid() != parent:  # it died before the request took effect
        os.kill(os.getpid(), sig)


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit(143): cleanup code and exit handlers run as on Ctrl-C."""

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def leave(code: int) -> None:
    """Exit with `code` now, stdout and stderr flushed, without the interpreter's teardown: for a child whose
    results are written and whose resources are released. Its teardown of torch only delays the parent, and in
    a rank would destroy gloo's threads, which outlive destroy_process_group and abort it now and then (SIGABRT,
    'terminate called without an active exception', pytorch#190489)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
