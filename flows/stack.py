"""`gpuflow stack`: a Prefect server and an MLflow tracking server for a team, on PostgreSQL (flows/postgres.py),
behind basic-auth credentials (flows/credentials.py), in the foreground until Ctrl-C or SIGTERM; one stack at a
time on a <data> folder that is its account's alone (docs/machines.md).
"""

from __future__ import annotations

import fcntl
import os
import pwd
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from pydantic import BaseModel, Field

from gpuflow.training.errors import UserError
from gpuflow.training.reaper import start_supervised, stop_supervised

from .api import http_status, server_environment
from .calls import QUIET
from .credentials import FILE as CREDENTIALS_FILE
from .credentials import Credentials, stack_credentials, write_private
from .postgres import Cluster, create_databases, database, password_env, run, split_password
from .settings import LOOPBACK, mlflow_server_environment

AUTH_CACHE_TTL_S = 60  # MLflow's own cache of verified basic-auth credentials (off by default)
STUDY_VARIABLE = "gpuflow_sweep_storage"  # the Prefect Variable where sweeps find the stack's study database
MLFLOW_DEFAULT_PERMISSION = "READ"  # what a user the admin adds may do before being granted more
STOP_GRACE_S = 30
READY_S = 180


class StackService(BaseModel):
    """`gpuflow stack`: a Prefect server and an MLflow tracking server on PostgreSQL."""

    data: str = Field(description="folder of the stack: its PostgreSQL cluster (unless --database-url), "
                      "Prefect's home, MLflow's artifacts and the servers' credentials; kept across restarts")
    database_url: str | None = Field(None, description="an existing PostgreSQL server, postgresql://user@host[:port]; "
                                     "its password in PGPASSWORD or ~/.pgpass (one in the URL is refused: `ps` shows it "
                                     "to every account) (default: a cluster of its own in <data>/postgres)")
    host: str = Field(LOOPBACK, description="address both servers listen on (both ask for the credentials in "
                      "<data>/credentials.env; put a TLS proxy in front before opening it: see docs/machines.md)")
    prefect_port: int = Field(4200, ge=1, le=65535, description="port of the Prefect server")
    mlflow_port: int = Field(5000, ge=1, le=65535, description="port of the MLflow tracking server")
    allowed_hosts: str | None = Field(None, description="host names clients reach the MLflow server by, when not "
                                      "its address (MLflow's --allowed-hosts, comma-separated)")


def hold_lock(data: Path) -> int:
    """An exclusive lock on <data>/stack.lock, or a one-line refusal. Every process of the stack
    inherits it, so it is free only once nothing of this stack is left."""
    fd = os.open(data / "stack.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise UserError(f"a gpuflow stack (pid {holder}) runs on {data}, or its servers are still stopping: stop "
                        "it or wait for it, or give another --data") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def make_private(data: Path, own_cluster: bool) -> None:
    """<data> and what the stack keeps there for its account alone; when root, PostgreSQL's group may
    pass through <data> (not list it) to reach its own folders. Folders made by older stacks included."""
    if os.geteuid() == 0 and own_cluster:
        os.chown(data, 0, pwd.getpwnam("postgres").pw_gid)
        data.chmod(0o710)
    else:
        os.chown(data, os.geteuid(), os.getegid())
        data.chmod(0o700)
    for name in ("artifacts", "prefect"):
        (data / name).mkdir(mode=0o700, exist_ok=True)
        (data / name).chmod(0o700)
    for f in data.iterdir():
        if f.is_file():
            os.chown(f, os.geteuid(), os.getegid())
            f.chmod(0o600)


def prefect_env(data: Path, url: str, credentials: Credentials) -> dict:
    """Prefect's server and migration: every setting, the database's password and the auth string included, by
    the environment, which only this account reads (`ps` shows arguments to all)."""
    env = dict(server_environment(), **password_env(url), PREFECT_HOME=str(data / "prefect"),
               PREFECT_API_DATABASE_CONNECTION_URL=database(url, "prefect", "asyncpg"),
               PREFECT_SERVER_DATABASE_MIGRATE_ON_START="false", PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_SERVER_API_AUTH_STRING=credentials.prefect_auth_string,
               PREFECT_API_AUTH_STRING=credentials.prefect_auth_string)  # the server's own clients, if any
    env.pop("PREFECT_API_URL", None)
    return env


def quiet_mlflow_server(env: dict) -> dict:
    """`env` without what the MLflow server says at each start that nobody can act on: its app's import of a
    deprecated Starlette module, and basic-auth's "still experimental" warning (MLflow's errors still show), unless
    the operator asked for them (PYTHONWARNINGS, or an MLFLOW_LOGGING_LEVEL other than gpuflow's own default)."""
    quiet = dict(env, PYTHONWARNINGS=env.get("PYTHONWARNINGS") or "ignore:starlette.middleware.wsgi is deprecated")
    if env.get("MLFLOW_LOGGING_LEVEL") in (None, QUIET["MLFLOW_LOGGING_LEVEL"]):
        quiet["MLFLOW_LOGGING_LEVEL"] = "ERROR"
    return quiet


def mlflow_env(data: Path, url: str, credentials: Credentials) -> dict:
    """MLflow's basic-auth app: its users in the database `mlflow_auth`, the admin being the stack's credentials."""
    config = data / "mlflow-auth.ini"
    write_private(config, "[mlflow]\n"
                  f"default_permission = {MLFLOW_DEFAULT_PERMISSION}\n"
                  f"database_uri = {database(url, 'mlflow_auth', 'psycopg')}\n"
                  "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                  # cached (HMAC-keyed) to skip the slow hash check per call; the stack changes no password
                  f"auth_cache_ttl_seconds = {AUTH_CACHE_TTL_S}\n")
    return dict(quiet_mlflow_server(mlflow_server_environment()), **password_env(url), MLFLOW_AUTH_CONFIG_PATH=str(config),
                MLFLOW_AUTH_ADMIN_USERNAME=credentials.mlflow_username,
                MLFLOW_AUTH_ADMIN_PASSWORD=credentials.mlflow_password,  # used only to create the admin
                MLFLOW_FLASK_SERVER_SECRET_KEY=secrets.token_hex(32))  # signs the sign-up form: the same in all workers


def refuse_a_shown_password(url: str | None) -> None:
    """A password in --database-url is refused before anything starts: the stack hides it from the processes it
    starts, but `ps` shows the stack's own arguments to every account for as long as it runs."""
    if url and split_password(url)[1]:
        raise UserError(f"--database-url {split_password(url)[0]} holds a password, which `ps` shows to every account while the "
                        "stack runs: leave it out of the URL and give it in PGPASSWORD or ~/.pgpass (libpq's own), "
                        "e.g. `PGPASSWORD=... gpuflow stack --data DIR --database-url postgresql://user@db-host:5432`")


def publish_study_storage(api: str, url: str, credentials: Credentials) -> None:
    """Tell sweeps where the stack keeps studies (a Prefect Variable), unless that would show a password."""
    if split_password(url)[1] or os.environ.get("PGPASSWORD"):
        print("gpuflow stack: sweeps keep their studies where --storage says (the database takes a password, which "
              "a Prefect Variable would show to every API user)", flush=True)
        return
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings
    from prefect.variables import Variable

    with temporary_settings({PREFECT_API_URL: api, PREFECT_API_AUTH_STRING: credentials.prefect_auth_string}):
        Variable.set(STUDY_VARIABLE, url, overwrite=True)


def wait_for_servers(checks: dict[str, tuple[str, str]], procs: list[subprocess.Popen], stop: dict,
                     credentials_file: Path) -> bool:
    """Until each server answers an authenticated request (health checks need none, so prove nothing); False if
    the stack was stopped (SIGTERM) meanwhile."""
    deadline = time.monotonic() + READY_S
    while True:
        codes = {name: http_status(url, auth, timeout=5) for name, (url, auth) in checks.items()}
        if all(code == 200 for code in codes.values()):
            return True
        refused = [name for name, code in codes.items() if code in (401, 403)]
        if refused:
            raise UserError(f"{refused[0]} refused the credentials in {credentials_file}: put back the file the "
                            "stack made at its first start (MLflow keeps the admin password it was first given, "
                            "in the database mlflow_auth)")
        if stop["signal"]:  # stopped while starting: no failure of the servers'
            return False
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            raise UserError("a server of the stack did not start; see its output above")
        time.sleep(0.5)


def announce(data: Path, credentials: Credentials, made: bool, api: str, ui: str) -> None:
    path = data / CREDENTIALS_FILE
    if made:  # secrets are shown this once; later starts only say where they are
        shown = "".join(f"\n  {k}={v}" for k, v in credentials.client_env().items())
        print(f"gpuflow stack: made the servers' credentials, shown this once and kept in {path} (0600):{shown}",
              flush=True)
    print(f"gpuflow stack: ready. On every machine, with a copy of {path} (keep it 0600):\n"
          f"  export PREFECT_API_URL={api} MLFLOW_TRACKING_URI={ui}\n"
          f"  set -a; . {path}; set +a", flush=True)


def serve_stack(s: StackService) -> int:
    """Database, migrations, then both servers until stopped; what this process started stopped on the way out."""
    refuse_a_shown_password(s.database_url)
    data = Path(s.data).expanduser().resolve()
    data.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock = hold_lock(data)  # before anything else: a second stack on <data> touches nothing
    os.umask(0o077)  # what the stack and its servers write is its account's alone
    cluster = None if s.database_url else Cluster(data)
    procs: list[subprocess.Popen] = []
    stop = {"signal": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(signal=True))
    try:
        make_private(data, own_cluster=cluster is not None)
        credentials, made = stack_credentials(data)
        if cluster:
            cluster.start(lock)
        url = s.database_url or cluster.url()
        if not cluster:
            create_databases(url)
        p_env, mlflow_db = prefect_env(data, url, credentials), database(url, "mlflow", "psycopg")
        run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"], "Prefect's migration", p_env)
        run([sys.executable, "-m", "mlflow", "db", "upgrade", mlflow_db], "MLflow's migration",
            dict(os.environ, **password_env(url)))
        procs.append(start_supervised([sys.executable, "-m", "prefect", "server", "start", "--host", s.host,
                                       "--port", str(s.prefect_port)], env=p_env, pass_fds=(lock,)))
        procs.append(start_supervised([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", mlflow_db,
                                       "--app-name", "basic-auth",
                                       "--serve-artifacts", "--artifacts-destination", str(data / "artifacts"),
                                       # one worker: --workers N loses TCP_NODELAY (Kludex/uvicorn#3149)
                                       "--host", s.host, "--port", str(s.mlflow_port), "--workers", "1",
                                       "--uvicorn-opts", "--no-access-log",  # a line per call drowned the rest
                                       *(["--allowed-hosts", s.allowed_hosts] if s.allowed_hosts else [])],
                                      env=mlflow_env(data, url, credentials), pass_fds=(lock,)))
        api, ui = f"http://{s.host}:{s.prefect_port}/api", f"http://{s.host}:{s.mlflow_port}"
        if not wait_for_servers({"Prefect": (api + "/admin/version", credentials.prefect_header()),
                                 "MLflow": (ui + "/api/2.0/mlflow/experiments/search?max_results=1",
                                            credentials.mlflow_header())}, procs, stop, data / CREDENTIALS_FILE):
            return 0
        publish_study_storage(api, database(url, "optuna", "psycopg"), credentials)
        announce(data, credentials, made, api, ui)
        while not stop["signal"] and all(p.poll() is None for p in procs):
            time.sleep(0.5)
        return 0 if stop["signal"] else 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop_supervised(procs, grace_s=STOP_GRACE_S)
        if cluster:
            cluster.stop()
