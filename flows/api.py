"""The temporary Prefect API of a `gpuflow` command when PREFECT_API_URL is unset: `prefect server start` in a
session of its own, so a Ctrl-C stops the flow (which records its end) before the server. Servers on one
PREFECT_HOME start one at a time (each migrates the shared database) and keep concurrency leases in that home.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO, Iterator

from gpuflow.training.reaper import start_supervised, stop_supervised

STARTUP_TIMEOUT_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"  # Prefect's own name, read by both
STARTUP_TIMEOUT_DEFAULT_S = 180  # a busy host starts a server far slower than an idle one
# Prefect's default keeps leases in the memory of the server that granted them, unseen by the others on a home.
SERVER_DEFAULTS = {"PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect.server.concurrency.lease_storage.filesystem",
                   # `prefect deployment run --watch` shows the run's log lines (its reason when it fails)
                   "PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED": "true",
                   "PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED": "true"}


def startup_timeout() -> float:
    return float(os.environ.get(STARTUP_TIMEOUT_ENV) or STARTUP_TIMEOUT_DEFAULT_S)


def server_environment() -> dict[str, str]:
    """The environment for a Prefect server gpuflow starts: this one, with SERVER_DEFAULTS for what it does not set."""
    return {**SERVER_DEFAULTS, **os.environ}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str, authorization: str | None = None, timeout: float = 2) -> int | None:
    """The HTTP status of a GET of `url` (with that Authorization header); None while nothing answers."""
    headers = {"Authorization": authorization} if authorization else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def _lock_path() -> Path:
    """Beside the server's SQLite database; in PREFECT_HOME for any other database."""
    from prefect.settings import get_current_settings
    from sqlalchemy.engine import make_url

    settings = get_current_settings()
    url = make_url(settings.server.database.connection_url.get_secret_value())
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        return Path(f"{url.database}.gpuflow-start.lock").expanduser()
    return Path(settings.home).expanduser() / "gpuflow-api-start.lock"


@contextmanager
def one_start_at_a_time() -> Iterator[None]:
    """Held while a server on this PREFECT_HOME starts: two servers migrating one database break it."""
    path = _lock_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as lock:  # closing the file releases the lock
        deadline = None
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if deadline is None:
                    print("gpuflow: waiting for another Prefect API on this PREFECT_HOME to start", file=sys.stderr,
                          flush=True)
                    deadline = time.monotonic() + startup_timeout()
                elif time.monotonic() > deadline:
                    raise RuntimeError(f"another Prefect API start held {path} for over {startup_timeout():.0f} s "
                                       f"({STARTUP_TIMEOUT_ENV}); set PREFECT_API_URL to use a running server")
                time.sleep(0.2)
        yield


class TemporaryApi:
    """A `prefect server start` on a free port of loopback, started at once and stopped at exit; `up()` waits until
    it answers (its migrations done). Started before a command's imports, it boots while they run."""

    def __init__(self):
        self._starting = ExitStack()
        self._starting.enter_context(one_start_at_a_time())  # held until it is up
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}/api"
        cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port),
               "--no-ui", "--no-services", "--analytics-off"]
        print(f"gpuflow: starting a temporary Prefect API on {self.url} (set PREFECT_API_URL to use a server)",
              file=sys.stderr, flush=True)
        # Its messages go to a file: a pipe nobody reads while the flow runs could fill and block it.
        self.log = tempfile.TemporaryFile("w+")
        self.server = start_supervised(cmd, reap=False, stdout=subprocess.DEVNULL, stderr=self.log, text=True,
                                       env=server_environment(), start_new_session=True)
        # Stopped at exit, after Prefect's own exit hooks have sent their last logs and events.
        atexit.register(stop_supervised, [self.server], grace_s=15)

    def up(self) -> str:
        with self._starting:
            wait_until_up(self.server, self.url, self.log)
        return self.url


def temporary_api() -> TemporaryApi | None:
    """A temporary API, started now, when none is configured (PREFECT_API_URL); None when one is."""
    from prefect.settings import PREFECT_API_URL

    return None if PREFECT_API_URL.value() else TemporaryApi()


@contextmanager
def prefect_api(started: TemporaryApi | None = None) -> Iterator[str | None]:
    """The configured API (yields None), or a temporary server for the block (yields its URL): `started` (by
    `temporary_api()`), else one started here. Flow runs on a temporary server send no heartbeats: it runs no
    services (no automation reads them) and ends with the command, and without them a flow run's end does not
    wait up to 1 s for Prefect's heartbeat thread."""
    from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    api = started or temporary_api()
    if api is None:
        yield None
        return
    with temporary_settings(updates={PREFECT_API_URL: api.up(), PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield api.url


def wait_until_up(server: subprocess.Popen, url: str, log: IO[str]) -> None:
    """Returns once the server at url answers (its migrations done); raises if it exits or is late."""
    deadline = time.monotonic() + startup_timeout()
    while http_status(url + "/health") != 200:
        if server.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the Prefect API exited ({server.returncode}): {log.read()[-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the Prefect API on {url} was not up within {startup_timeout():.0f} s "
                               f"({STARTUP_TIMEOUT_ENV})")
        time.sleep(0.2)
