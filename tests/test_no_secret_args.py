"""No secret in any process's arguments: `ps` shows every account every command line, so the processes
`gpuflow stack` starts get the database password and the servers' credentials through their environment
(/proc/<pid>/environ is their account's alone), never their arguments."""

from __future__ import annotations

import secrets
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.parse
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from tests.helpers import child_env
from tests.servers import BIN, free_port
from tests.test_stack import Stack, _postgres_usable, stranger  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow

ROLE = "teamdb"
# characters a URL must escape: the stack must hand on the password, not its %-escaped form
PASSWORD = "pw-" + secrets.token_hex(8) + "/@:%"


def _as_postgres(*cmd: str) -> list[str]:
    return ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", "--", *cmd]


@contextmanager
def team_postgresql(base: Path) -> Iterator[int]:
    """A PostgreSQL server of the test's own on 127.0.0.1 (its port yielded) with a password-authenticated role
    ROLE that may create databases, as a team's database server would be; stopped after."""
    import psycopg
    from psycopg import sql

    pgdata, socket = base / "pg", base / "pg-socket"
    for d in (pgdata, socket):
        d.mkdir(mode=0o700)
        subprocess.run(["chown", "postgres:postgres", str(d)], check=True)
    # trust on the socket: its folder (0700) lets none but PostgreSQL's user and root in
    made = subprocess.run(_as_postgres("initdb", "-D", str(pgdata), "-U", "postgres", "--auth-local=trust",
                                       "--auth-host=scram-sha-256", "--no-sync", "--no-instructions"),
                          capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    port = free_port()
    server = subprocess.Popen(_as_postgres("postgres", "-D", str(pgdata), "-k", str(socket), "-p", str(port),
                                           "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"),
                              stdout=subprocess.DEVNULL, stderr=open(base / "pg.log", "w"))
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                conn = psycopg.connect(host=str(socket), port=port, user="postgres", dbname="postgres",
                                       autocommit=True)
                break
            except psycopg.OperationalError:
                assert server.poll() is None and time.monotonic() < deadline, (base / "pg.log").read_text()
                time.sleep(0.2)
        with conn:  # in this process: a password in psql's arguments would be the very leak looked for
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN CREATEDB PASSWORD {}").format(
                sql.Identifier(ROLE), sql.Literal(PASSWORD)))
        yield port
    finally:
        server.terminate()  # SIGTERM: PostgreSQL's smart shutdown, quick once the stack is gone
        server.wait(60)


class StackOn(Stack):
    """A stack on a database server given by --database-url."""

    def __init__(self, data: Path, database_url: str, **env: str):
        super().__init__(data)
        self.database_url, self.env = database_url, env

    def launch(self) -> int:
        log = open(self.data.parent / "stack.log", "a")
        earlier = log.tell()
        self.proc = subprocess.Popen([str(BIN / "gpuflow"), "stack", "--data", str(self.data), "--database-url",
                                      self.database_url, "--prefect-port", str(self.ports[0]), "--mlflow-port",
                                      str(self.ports[1])], env=child_env(**self.env), stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return earlier


class CommandLines:
    """Every command line `ps` showed another account, sampled in a thread until stopped."""

    def __init__(self, account: str):
        self.ps = ["setpriv", f"--reuid={account}", f"--regid={account}", "--clear-groups",
                   "ps", "-eww", "-o", "pid=,args="]  # ww: whole lines, where a password sits at the end
        self.seen: set[tuple[int, str]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def sample(self) -> None:
        out = subprocess.run(self.ps, capture_output=True, text=True, check=True, cwd="/").stdout
        for line in out.splitlines():
            pid, _, args = line.strip().partition(" ")
            self.seen.add((int(pid), args))

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(0.2)

    def __enter__(self) -> CommandLines:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)


@pytest.fixture
def base() -> Iterator[Path]:
    """A folder PostgreSQL's user can reach (not pytest's 0700 tree); gone after."""
    if why := _postgres_usable():
        pytest.skip(why)
    path = Path(tempfile.mkdtemp(prefix="gpuflow-no-secret-args-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_no_process_of_the_stack_shows_the_database_password_or_the_credentials_in_ps(base, stranger):
    with team_postgresql(base) as port:
        # a password in the URL would show in the stack's own arguments: refused before anything starts
        shown = f"postgresql://{ROLE}:{urllib.parse.quote(PASSWORD, safe='')}@127.0.0.1:{port}"
        refused = subprocess.run([str(BIN / "gpuflow"), "stack", "--data", str(base / "refused"), "--database-url",
                                  shown], env=child_env(), capture_output=True, text=True, timeout=120)
        assert refused.returncode != 0 and "holds a password, which `ps` shows" in refused.stderr, refused.stderr
        assert PASSWORD not in refused.stderr and not (base / "refused").exists()
        stack = StackOn(base / "data", f"postgresql://{ROLE}@127.0.0.1:{port}", PGPASSWORD=PASSWORD)
        try:
            with CommandLines(stranger) as lines:
                stack.start()  # migrations and both servers, sampled all along
                for _ in range(3):  # and while it serves
                    time.sleep(0.3)
                    lines.sample()
            c = stack.credentials()
        finally:
            stack.stop()
    started = [args for _, args in lines.seen]  # the stack's own line too: its URL holds no password
    assert any("mlflow db upgrade" in a for a in started) and any("mlflow server" in a for a in started), started
    hidden = {PASSWORD, urllib.parse.quote(PASSWORD, safe=""), PASSWORD[:19], c["PREFECT_API_AUTH_STRING"],
              c["PREFECT_API_AUTH_STRING"].partition(":")[2], c["MLFLOW_TRACKING_PASSWORD"]}
    assert [a for a in started if any(s in a for s in hidden)] == []
