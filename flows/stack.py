"""`gpuflow stack`: the servers a team shares, on PostgreSQL.

    gpuflow stack --data /srv/gpuflow            # PostgreSQL made and started in /srv/gpuflow/postgres
    gpuflow stack --data /srv/gpuflow --database-url postgresql://user@db-host:5432

A Prefect server (API and UI) and an MLflow tracking server that serves the artifacts itself
(`--serve-artifacts`, stored in <data>/artifacts), both on PostgreSQL, in the foreground until
Ctrl-C or SIGTERM, which stop them and the database. Clients need only the two URLs it prints
(PREFECT_API_URL, MLFLOW_TRACKING_URI): no database access, no shared filesystem.

Without --database-url, a PostgreSQL cluster of its own lives in <data>/postgres and listens on
a Unix socket in <data>/socket only: nothing on the network, and no password (trust auth on
that socket alone). Run as root, it runs as the `postgres` system user, which must be able to
reach <data>. With --database-url it uses that server's databases `prefect` and `mlflow`
(created if it may). The schemas are migrated once before the servers start: servers started
together would race on migrations. Sweeps keep their Optuna studies in its database `optuna`: the
stack publishes that URL in the Prefect Variable `gpuflow_sweep_storage` (unless the URL holds a
password, which a Variable would show to every API user: then pass --storage to the sweep).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

from pydantic import BaseModel, Field

from gpuflow.training.errors import UserError
from gpuflow.training.reaper import start_supervised

from .settings import LOOPBACK

DATABASES = ("prefect", "mlflow", "optuna")
STUDY_VARIABLE = "gpuflow_sweep_storage"  # the Prefect Variable where sweeps find the stack's study database
STOP_GRACE_S = 30


class StackService(BaseModel):
    """`gpuflow stack`: a Prefect server and an MLflow tracking server on PostgreSQL."""

    data: str = Field(description="folder of the stack: its PostgreSQL cluster (unless --database-url), "
                      "Prefect's home and MLflow's artifacts; kept across restarts")
    database_url: str | None = Field(None, description="an existing PostgreSQL server, postgresql://user[:password]"
                                     "@host[:port] (default: a cluster of its own in <data>/postgres)")
    host: str = Field(LOOPBACK, description="address both servers listen on (put an authenticating proxy in "
                      "front before opening it: see the README)")
    prefect_port: int = Field(4200, ge=1, le=65535, description="port of the Prefect server")
    mlflow_port: int = Field(5000, ge=1, le=65535, description="port of the MLflow tracking server")
    allowed_hosts: str | None = Field(None, description="host names clients reach the MLflow server by, when not "
                                      "its address (MLflow's --allowed-hosts, comma-separated)")


def as_postgres(cmd: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: then its tools run as the `postgres` system user."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


class Cluster:
    """A PostgreSQL cluster of the stack's own, on a Unix socket in <data>/socket."""

    def __init__(self, data: Path):
        self.dir, self.socket, self.log = data / "postgres", data / "socket", data / "postgres.log"

    def start(self) -> None:
        missing = [t for t in ("initdb", "pg_ctl") if not shutil.which(t)]
        if missing:
            raise UserError(f"{' and '.join(missing)} not found: install PostgreSQL (15 or later), or give "
                            "--database-url of a running server")
        for path in (self.dir.parent, self.socket):
            path.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            for path in (self.dir.parent, self.socket):
                shutil.chown(path, "postgres")
            self.log.touch()
            shutil.chown(self.log, "postgres")
        if not (self.dir / "PG_VERSION").is_file():
            run(as_postgres(["initdb", "-D", str(self.dir), "-U", "postgres", "-A", "trust", "--no-instructions"]),
                "initdb")
        run(as_postgres(["pg_ctl", "-D", str(self.dir), "-l", str(self.log), "-w", "-t", "120", "start", "-o",
                         f"-k {self.socket} -c listen_addresses=''"]), f"PostgreSQL (its log: {self.log})")

    def stop(self) -> None:
        subprocess.run(as_postgres(["pg_ctl", "-D", str(self.dir), "-w", "-m", "fast", "stop"]),
                       capture_output=True)

    def url(self) -> str:
        return f"postgresql://postgres@/?host={urllib.parse.quote(str(self.socket), safe='/')}"


def run(cmd: list[str], what: str, env: dict | None = None) -> None:
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise UserError(f"{what} failed (exit {p.returncode}): {(p.stderr or p.stdout).strip()[-1500:]}")


def database(url: str, name: str, driver: str) -> str:
    """`url` (postgresql://...) with database `name` and the SQLAlchemy driver (`asyncpg`, `psycopg`)."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit((f"postgresql+{driver}", parts.netloc, f"/{name}", parts.query, ""))


def create_databases(url: str) -> None:
    import psycopg

    parts = urllib.parse.urlsplit(url)
    query = dict(urllib.parse.parse_qsl(parts.query))
    conninfo = dict(host=query.get("host", parts.hostname), port=parts.port, user=parts.username,
                    password=parts.password, dbname="postgres")
    with psycopg.connect(**{k: v for k, v in conninfo.items() if v}, autocommit=True) as conn:
        have = {r[0] for r in conn.execute("SELECT datname FROM pg_database")}
        for name in DATABASES:
            if name not in have:
                conn.execute(f'CREATE DATABASE "{name}"')


def publish_study_storage(api: str, url: str) -> None:
    """Tell sweeps where the stack keeps studies (a Prefect Variable), unless that would show a password."""
    if urllib.parse.urlsplit(url).password:
        print("gpuflow stack: sweeps keep their studies where --storage says (the database URL holds a password, "
              "which a Prefect Variable would show to every API user)", flush=True)
        return
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.variables import Variable

    with temporary_settings({PREFECT_API_URL: api}):
        Variable.set(STUDY_VARIABLE, url, overwrite=True)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def serve_stack(s: StackService) -> int:
    """Database, migrations, then both servers until stopped; everything stopped on the way out."""
    data = Path(s.data).expanduser().resolve()
    cluster = None if s.database_url else Cluster(data)
    procs: list[subprocess.Popen] = []
    stop = {"signal": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(signal=True))
    try:
        if cluster:
            cluster.start()
        url = s.database_url or cluster.url()
        create_databases(url)
        prefect_env = dict(os.environ, PREFECT_HOME=str(data / "prefect"),
                           PREFECT_API_DATABASE_CONNECTION_URL=database(url, "prefect", "asyncpg"),
                           PREFECT_SERVER_DATABASE_MIGRATE_ON_START="false", PREFECT_SERVER_ANALYTICS_ENABLED="false")
        prefect_env.pop("PREFECT_API_URL", None)
        mlflow_db = database(url, "mlflow", "psycopg")
        run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"], "Prefect's migration", prefect_env)
        run([sys.executable, "-m", "mlflow", "db", "upgrade", mlflow_db], "MLflow's migration")
        (data / "artifacts").mkdir(parents=True, exist_ok=True)
        procs.append(start_supervised([sys.executable, "-m", "prefect", "server", "start", "--host", s.host,
                                       "--port", str(s.prefect_port)], env=prefect_env))
        procs.append(start_supervised([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", mlflow_db,
                                       "--serve-artifacts", "--artifacts-destination", str(data / "artifacts"),
                                       "--host", s.host, "--port", str(s.mlflow_port), "--workers", "2",
                                       *(["--allowed-hosts", s.allowed_hosts] if s.allowed_hosts else [])]))
        api, ui = f"http://{s.host}:{s.prefect_port}/api", f"http://{s.host}:{s.mlflow_port}"
        deadline = time.monotonic() + 180
        while not (healthy(api + "/health") and healthy(ui + "/health")):
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline or stop["signal"]:
                raise UserError("a server of the stack did not start; see its output above")
            time.sleep(0.5)
        publish_study_storage(api, database(url, "optuna", "psycopg"))
        print(f"gpuflow stack: ready. On every machine:\n  export PREFECT_API_URL={api}\n"
              f"  export MLFLOW_TRACKING_URI={ui}", flush=True)
        while not stop["signal"] and all(p.poll() is None for p in procs):
            time.sleep(0.5)
        return 0 if stop["signal"] else 1
    except KeyboardInterrupt:
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # the reaper stops the server and all it started
        for p in procs:
            try:
                p.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if cluster:
            cluster.stop()
