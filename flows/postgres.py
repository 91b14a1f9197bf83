"""The stack's PostgreSQL (flows/stack.py): its own cluster in <data>/postgres under the reaper, on a private Unix
socket with peer authentication, its databases owned by ROLE (no superuser); or a server given by --database-url."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import time
import urllib.parse
from pathlib import Path

from gpuflow.training.errors import UserError
from gpuflow.training.reaper import start_supervised, stop_supervised

from .credentials import write_private

DATABASES = ("prefect", "mlflow", "mlflow_auth", "optuna")
ROLE = "gpuflow"  # owns the databases; the servers and sweeps connect as it; no superuser, so no COPY ... PROGRAM
SUPERUSER = "postgres"  # the cluster's own superuser: the stack's setup alone
READY_S = 180  # how long PostgreSQL may take to accept connections


def as_postgres(cmd: list[str]) -> list[str]:
    """`cmd`, as the `postgres` system user when root (PostgreSQL refuses to run as root)."""
    if os.geteuid() != 0:
        return cmd
    # setpriv execs the command; runuser would stay between and kill PostgreSQL soon after passing on a stop
    return ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", "--", *cmd]


def run(cmd: list[str], what: str, env: dict | None = None) -> None:
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise UserError(f"{what} failed (exit {p.returncode}): {(p.stderr or p.stdout).strip()[-1500:]}")


class Cluster:
    """A PostgreSQL cluster of the stack's own, under the reaper, on a Unix socket in <data>/socket."""

    def __init__(self, data: Path):
        self.dir, self.socket, self.log = data / "postgres", data / "socket", data / "postgres.log"
        self.account = pwd.getpwuid(os.geteuid()).pw_name  # the servers' OS user: mapped to ROLE
        self.owner = "postgres" if os.geteuid() == 0 else self.account  # the OS user PostgreSQL runs as
        self.proc: subprocess.Popen | None = None

    def start(self, lock: int) -> None:
        missing = [t for t in ("initdb", "postgres") if not shutil.which(t)]
        if missing:
            raise UserError(f"{' and '.join(missing)} not found: install PostgreSQL (15 or later), or give "
                            "--database-url of a running server")
        self._prepare_folders()
        if not (self.dir / "PG_VERSION").is_file():
            run(as_postgres(["initdb", "-D", str(self.dir), "-U", SUPERUSER, "--auth-local=peer",
                             "--auth-host=scram-sha-256", "--no-instructions"]), "initdb")
        self._write_access_rules()
        with open(self.log, "a") as log:
            # a session of its own: a terminal's Ctrl-C reaches the stack and its servers, and the stack stops
            # PostgreSQL after them (first, Prefect's services would log a traceback a query until they stopped)
            self.proc = start_supervised(as_postgres(
                ["postgres", "-D", str(self.dir), "-k", str(self.socket), "-c", "listen_addresses=",
                 "-c", "unix_socket_permissions=0700"]), stdout=log, stderr=subprocess.STDOUT, pass_fds=(lock,),
                start_new_session=True)
        self._wait_ready()
        self._set_up_role()

    def _prepare_folders(self) -> None:
        for path in (self.dir, self.socket):
            path.mkdir(mode=0o700, exist_ok=True)  # made here: PostgreSQL's user may not write in <data>
            path.chmod(0o700)
            shutil.chown(path, self.owner)
        self.log.touch(mode=0o600)

    def _write_access_rules(self) -> None:
        """Peer authentication on the socket alone; pg_ident.conf says which OS user may be which role."""
        hba = "# written by gpuflow stack at each start\nlocal all all peer map=stack\n"
        idents = dict.fromkeys([(self.owner, SUPERUSER), (self.account, SUPERUSER), (self.account, ROLE)])
        ident = "# written by gpuflow stack at each start\n" + "".join(f"stack {u} {r}\n" for u, r in idents)
        for name, text in (("pg_hba.conf", hba), ("pg_ident.conf", ident)):
            write_private(self.dir / name, text)
            shutil.chown(self.dir / name, self.owner)

    def _conninfo(self, dbname: str) -> dict:
        return dict(host=str(self.socket), user=SUPERUSER, dbname=dbname)

    def _wait_ready(self) -> None:
        import psycopg

        deadline = time.monotonic() + READY_S
        while True:
            try:
                psycopg.connect(**self._conninfo("postgres")).close()
                return
            except psycopg.OperationalError as e:
                starting = e.sqlstate in (None, "57P03")  # nothing listens yet, or "the database system is starting up"
                if not starting or self.proc.poll() is not None or time.monotonic() > deadline:
                    raise UserError(f"PostgreSQL did not start in {self.dir} ({str(e).strip()}); its log: "
                                    f"{self.log}") from None
            time.sleep(0.2)

    def _set_up_role(self) -> None:
        """ROLE, no superuser, owns the stack's databases (and the objects an older stack made in them)."""
        import psycopg

        with psycopg.connect(**self._conninfo("postgres"), autocommit=True) as conn:
            if not conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (ROLE,)).fetchone():
                conn.execute(f'CREATE ROLE "{ROLE}"')
            conn.execute(f'ALTER ROLE "{ROLE}" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS')
            have = {r[0] for r in conn.execute("SELECT datname FROM pg_database")}
            for name in DATABASES:
                if name in have:
                    conn.execute(f'ALTER DATABASE "{name}" OWNER TO "{ROLE}"')
                else:
                    conn.execute(f'CREATE DATABASE "{name}" OWNER "{ROLE}"')
        for name in have.intersection(DATABASES):
            with psycopg.connect(**self._conninfo(name), autocommit=True) as conn:
                conn.execute(HAND_OVER)

    def stop(self) -> None:
        """Fast shutdown: SIGINT, which the reaper passes on (sessions ended, a checkpoint, exit)."""
        if self.proc:
            stop_supervised([self.proc], signal.SIGINT)

    def url(self) -> str:
        return f"postgresql://{ROLE}@/?host={urllib.parse.quote(str(self.socket), safe='/')}"


# Objects an older stack's superuser made go to ROLE: tables first (they take their sequences); extensions' stay.
HAND_OVER = f"""
DO $$
DECLARE r record;
BEGIN
  FOR r IN SELECT oid::regclass AS name FROM pg_class WHERE relnamespace = 'public'::regnamespace
           AND relkind IN ('r', 'p', 'v', 'm', 'f') AND relowner <> '{ROLE}'::regrole LOOP
    EXECUTE format('ALTER TABLE %s OWNER TO {ROLE}', r.name);
  END LOOP;
  FOR r IN SELECT oid::regclass AS name FROM pg_class WHERE relnamespace = 'public'::regnamespace
           AND relkind = 'S' AND relowner <> '{ROLE}'::regrole LOOP
    EXECUTE format('ALTER SEQUENCE %s OWNER TO {ROLE}', r.name);
  END LOOP;
  FOR r IN SELECT oid::regtype AS name, typtype FROM pg_type WHERE typnamespace = 'public'::regnamespace
           AND typtype IN ('e', 'd') AND typowner <> '{ROLE}'::regrole LOOP
    EXECUTE format('ALTER %s %s OWNER TO {ROLE}', CASE r.typtype WHEN 'd' THEN 'DOMAIN' ELSE 'TYPE' END, r.name);
  END LOOP;
  FOR r IN SELECT p.oid::regprocedure AS name FROM pg_proc p WHERE p.pronamespace = 'public'::regnamespace
           AND p.proowner <> '{ROLE}'::regrole AND NOT EXISTS (SELECT 1 FROM pg_depend d
             WHERE d.classid = 'pg_proc'::regclass AND d.objid = p.oid AND d.deptype = 'e') LOOP
    EXECUTE format('ALTER ROUTINE %s OWNER TO {ROLE}', r.name);
  END LOOP;
END $$
"""


def split_password(url: str) -> tuple[str, str | None]:
    """`url` (postgresql://...) without its password, wherever it is (after the user name, or a `password` query
    parameter), and that password, unescaped (None when it holds none)."""
    parts = urllib.parse.urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    user, colon, escaped = userinfo.partition(":")
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    in_query = [v for k, v in query if k == "password"]
    if in_query:
        parts = parts._replace(query=urllib.parse.urlencode([(k, v) for k, v in query if k != "password"]))
    password = urllib.parse.unquote(escaped) if colon else next(iter(in_query), None)
    return parts._replace(netloc=f"{user}{at}{hostport}").geturl(), password or None


def password_env(url: str) -> dict[str, str]:
    """The environment that hands `url`'s password to a child: libpq's own PGPASSWORD, which psycopg and asyncpg
    read; a process's environment is its account's alone, where its arguments show in every account's `ps`."""
    password = split_password(url)[1]
    return {"PGPASSWORD": password} if password else {}


def database(url: str, name: str, driver: str) -> str:
    """`url` (postgresql://...) with database `name` and the SQLAlchemy driver (`asyncpg`, `psycopg`), and without
    its password (which goes by `password_env`)."""
    parts = urllib.parse.urlsplit(split_password(url)[0])
    return urllib.parse.urlunsplit((f"postgresql+{driver}", parts.netloc, f"/{name}", parts.query, ""))


def create_databases(url: str) -> None:
    """The databases on a server given by --database-url, as its user (who then owns them)."""
    import psycopg

    bare, password = split_password(url)
    parts = urllib.parse.urlsplit(bare)
    query = dict(urllib.parse.parse_qsl(parts.query))
    conninfo = dict(host=query.get("host", parts.hostname), port=parts.port,
                    user=parts.username and urllib.parse.unquote(parts.username), password=password, dbname="postgres")
    try:
        conn = psycopg.connect(**{k: v for k, v in conninfo.items() if v}, autocommit=True)
    except psycopg.OperationalError as e:
        reason = " ".join(str(e).split())  # libpq words it over several lines
        raise UserError(f"cannot connect to --database-url {bare} ({reason}): check the URL and the password "
                        "(best in PGPASSWORD or ~/.pgpass, which `ps` does not show)") from None
    with conn:
        have = {r[0] for r in conn.execute("SELECT datname FROM pg_database")}
        for name in DATABASES:
            if name not in have:
                conn.execute(f'CREATE DATABASE "{name}"')
