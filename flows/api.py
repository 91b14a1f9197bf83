"""The temporary Prefect API of a `gpuflow` command when PREFECT_API_URL is unset: `prefect server start` in a
session of its own, so a Ctrl-C stops the flow (which records its end) before the server, on a PREFECT_HOME of its
own: it shares no state with any other server (#58: on the user's ~/.prefect it saw a `gpuflow serve`'s device
limit, and a plain run queued behind served runs). A migrated empty database kept in PREFECT_HOME is copied in, so
that each start does not migrate anew.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import closing, contextmanager
from pathlib import Path
from typing import IO, Iterator

from gpuflow.training.files import only_mine
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


TEMPLATE = "gpuflow/temporary-api-prefect-{version}.db"  # in PREFECT_HOME: an empty, migrated database to copy


def template_path() -> Path:
    import prefect
    from prefect.settings import get_current_settings

    return Path(get_current_settings().home).expanduser() / TEMPLATE.format(version=prefect.__version__)


def _own_template(path: Path) -> int | None:
    """An open descriptor of the template if it is a plain file of this account that no other can write; else None
    (none yet, or planted: a database another account wrote would be the API's)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    if only_mine(os.fstat(fd)):
        return fd
    os.close(fd)
    return None


def private_home() -> tuple[Path, bool]:
    """A new PREFECT_HOME of this command alone (mode 0700), with a copy of the template database if there is one;
    (the home, whether it got the copy). Nothing of another user's, another serve's or an earlier run's is in it:
    not the device limit of a `gpuflow serve` (a plain run queued behind its served runs), not a stranger's runs."""
    home = Path(tempfile.mkdtemp(prefix="gpuflow-prefect-"))
    fd = _own_template(template_path())
    if fd is None:
        return home, False
    with os.fdopen(fd, "rb") as template, open(home / "prefect.db", "wb") as db:
        shutil.copyfileobj(template, db)
    return home, True


def save_template(home: Path) -> None:
    """Keep the just-migrated database of `home` as the template, so the next temporary API starts without
    migrating (about half its start); a failure only costs the next start that time."""
    path = template_path()
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".template-")  # 0600
        os.close(fd)
        with closing(sqlite3.connect(home / "prefect.db")) as src, closing(sqlite3.connect(tmp)) as dst:
            src.backup(dst)  # with what its write-ahead log holds: a copy of the file alone misses it
            dst.execute("PRAGMA journal_mode=DELETE")  # one self-contained file to copy (the server sets WAL again)
        os.replace(tmp, path)
    except (OSError, sqlite3.Error) as e:
        print(f"gpuflow: could not keep the temporary API's database as {path} ({e}); the next one migrates anew",
              file=sys.stderr, flush=True)


class TemporaryApi:
    """A `prefect server start` on a free port of loopback and on a private PREFECT_HOME, started at once and stopped
    at exit (its home removed then); `up()` waits until it answers (its migrations done). Started before a
    command's imports, it boots while they run."""

    def __init__(self):
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}/api"
        self.home, self._copied = private_home()
        cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port),
               "--no-ui", "--no-services", "--analytics-off"]
        print(f"gpuflow: starting a temporary Prefect API on {self.url} (set PREFECT_API_URL to use a server)",
              file=sys.stderr, flush=True)
        # Its messages go to a file: a pipe nobody reads while the flow runs could fill and block it.
        self.log = tempfile.TemporaryFile("w+")
        # the home's own database, whatever PREFECT_SERVER_DATABASE_CONNECTION_URL says for the user's servers
        env = dict(server_environment(), PREFECT_HOME=str(self.home),
                   PREFECT_SERVER_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{self.home / 'prefect.db'}")
        atexit.register(shutil.rmtree, self.home, ignore_errors=True)  # at exit hooks run last first: after the stop
        self.server = start_supervised(cmd, reap=False, stdout=subprocess.DEVNULL, stderr=self.log, text=True,
                                       env=env, start_new_session=True)
        # Stopped at exit, after Prefect's own exit hooks have sent their last logs and events.
        atexit.register(stop_supervised, [self.server], grace_s=15)

    def up(self) -> str:
        wait_until_up(self.server, self.url, self.log)
        if not self._copied:
            save_template(self.home)
            self._copied = True
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
