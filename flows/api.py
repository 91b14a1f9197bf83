"""The Prefect API a `gpuflow` command uses when no server is set (PREFECT_API_URL unset).

Prefect's own ephemeral API runs in this terminal's process group, so a Ctrl-C (or a SIGTERM to
the group) stopped it first and left the flow unable to record its end. This one is the same
`prefect server start` a user would run, on a free 127.0.0.1 port, in a session of its own:
only the flow is interrupted, ends its run, then stops the server. It dies with this process.
"""

from __future__ import annotations

import atexit
import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from typing import Iterator

from gpuflow.training.lifetime import die_with_parent

STARTUP_TIMEOUT_S = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", 180))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@contextmanager
def prefect_api() -> Iterator[str | None]:
    """The configured API (yields None), or a temporary server for the block (yields its URL)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if PREFECT_API_URL.value():
        yield None
        return
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port),
           "--no-ui", "--no-services", "--analytics-off"]
    print(f"gpuflow: starting a temporary Prefect API on {url} (set PREFECT_API_URL to use a server)",
          file=sys.stderr, flush=True)
    # Its messages go to a file: a pipe nobody reads while the flow runs could fill and block it.
    log = tempfile.TemporaryFile("w+")
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True,
                              start_new_session=True,
                              preexec_fn=functools.partial(die_with_parent, signal.SIGTERM, os.getpid()))
    # Stopped at exit, after Prefect's own exit hooks have sent their last logs and events.
    atexit.register(_stop, server)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not _healthy(url):
        if server.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the temporary Prefect API exited ({server.returncode}): {log.read()[-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the temporary Prefect API was not up within {STARTUP_TIMEOUT_S:.0f} s "
                               "(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)")
        time.sleep(0.2)
    with temporary_settings(updates={PREFECT_API_URL: url}):
        yield url


def _stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(15)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
