"""The team stack (`gpuflow stack`, flows/stack.py) on a real PostgreSQL made by the command in a
temporary folder: Prefect and MLflow servers on it, runs and a scheduled run through them, a
model loaded back through the HTTP server alone, and everything still there after a restart; no
way in for another account or a request without the credentials; one stack per folder, and no
PostgreSQL left behind by a stack killed outright."""

from __future__ import annotations

import base64
import datetime
import fcntl
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import mlflow
import numpy as np
import psutil
import pytest

from gpuflow.flows.credentials import load_credentials
from gpuflow.flows.stack import STUDY_VARIABLE
from tests.helpers import child_env
from tests.servers import BIN, free_port

pytestmark = pytest.mark.slow

TINY = ["--gpus", "cpu", "--strategy", "single", "--epochs", "1"]
PREFECT_PROBE = "/admin/version"  # an API path that needs the credentials (/health and /ready do not)
MLFLOW_PROBE = "/api/2.0/mlflow/experiments/search?max_results=1"


def _postgres_usable() -> str | None:
    if not (shutil.which("initdb") and shutil.which("postgres")):
        return "PostgreSQL's initdb and postgres are not on the PATH"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root without a `postgres` system user to run PostgreSQL as"
    return None


class Stack:
    def __init__(self, data: Path):
        self.data, self.ports = data, (free_port(), free_port())
        self.api = f"http://127.0.0.1:{self.ports[0]}/api"
        self.ui = f"http://127.0.0.1:{self.ports[1]}"
        self.proc: subprocess.Popen | None = None

    def launch(self) -> int:
        """Start `gpuflow stack`; where its output starts in the log."""
        log = open(self.data.parent / "stack.log", "a")
        earlier = log.tell()  # the output of this start alone: an earlier start said "ready" too
        self.proc = subprocess.Popen([str(BIN / "gpuflow"), "stack", "--data", str(self.data), "--prefect-port",
                                      str(self.ports[0]), "--mlflow-port", str(self.ports[1])], env=child_env(),
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return earlier

    def start(self) -> None:
        earlier = self.launch()
        deadline = time.monotonic() + 240
        while "ready" not in self.output(earlier).split("gpuflow stack:")[-1]:
            assert self.proc.poll() is None, self.output(earlier)[-3000:]
            assert time.monotonic() < deadline, "the stack did not start"
            time.sleep(0.5)

    def output(self, since: int = 0) -> str:
        return (self.data.parent / "stack.log").read_bytes()[since:].decode(errors="replace")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def credentials(self) -> dict:
        """What a client loads from the stack's credentials.env."""
        return load_credentials(self.data / "credentials.env").client_env()

    def env(self, **extra) -> dict:
        return child_env(PREFECT_API_URL=self.api, MLFLOW_TRACKING_URI=self.ui, **self.credentials(), **extra)

    def prefect_settings(self) -> dict:
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL

        return {PREFECT_API_URL: self.api, PREFECT_API_AUTH_STRING: self.credentials()["PREFECT_API_AUTH_STRING"]}

    def answers(self) -> dict[str, int]:
        """HTTP status of a GET of each server's API with the stack's credentials."""
        c = self.credentials()
        mlflow_user = f"{c['MLFLOW_TRACKING_USERNAME']}:{c['MLFLOW_TRACKING_PASSWORD']}"
        return {"prefect": _status(self.api + PREFECT_PROBE, c["PREFECT_API_AUTH_STRING"]),
                "mlflow": _status(self.ui + MLFLOW_PROBE, mlflow_user)}


def _status(url: str, user_password: str) -> int:
    auth = "Basic " + base64.b64encode(user_password.encode()).decode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": auth}), timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@contextmanager
def own_stack(name: str) -> Iterator[Stack]:
    """A stack of this test's own (not started), in a folder PostgreSQL's user can reach; gone after."""
    if why := _postgres_usable():
        pytest.skip(why)
    base = Path(tempfile.mkdtemp(prefix=f"gpuflow-stack-{name}-"))
    base.chmod(0o755)
    s = Stack(base / "data")
    try:
        yield s
    finally:
        s.stop()
        subprocess.run(["pkill", "-f", f"postgres -D {s.data}"], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def stack():
    with own_stack("shared") as s:  # PostgreSQL's user must reach its folder: not pytest's 0700 tree
        s.start()
        with pytest.MonkeyPatch.context() as env:  # MLflow clients in this process read them at each request
            for k, v in s.credentials().items():
                env.setenv(k, v)
            yield s


def gpuflow_run(stack: Stack, cwd: Path, *args: str) -> dict:
    cwd.mkdir(parents=True, exist_ok=True)
    p = subprocess.run([str(BIN / "gpuflow"), "run", *TINY, *args], cwd=cwd, env=stack.env(), capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout[p.stdout.index("{"):])


def test_runs_a_scheduled_run_and_the_registry_live_on_the_stack_and_survive_a_restart(stack, tmp_path):
    # three runs at once, each from its own folder, all into the one tracking server
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda i: gpuflow_run(stack, tmp_path / f"user{i}", "--seed", str(i)), range(3)))
    client = mlflow.MlflowClient(stack.ui)
    for out in outs:
        run = client.get_run(out["run_id"])
        assert run.info.status == "FINISHED" and run.data.metrics["val_accuracy"] > 0.5
        assert [m.step for m in client.get_metric_history(out["run_id"], "val_loss")] == [1]

    # a scheduled run of a served deployment, through the PostgreSQL-backed scheduler
    served = tmp_path / "served"
    served.mkdir()
    serve = subprocess.Popen([str(BIN / "gpuflow"), "serve"], cwd=served, env=stack.env(),
                             stdout=open(tmp_path / "serve.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        flow_run = _scheduled(stack, "train-pipeline/ddp", {"epochs": 1, "gpus": "cpu", "cpu_processes": 1})
        assert flow_run.state.type.value == "COMPLETED", (tmp_path / "serve.log").read_text()[-3000:]
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        serve.wait(60)
    runs = client.search_runs([client.get_experiment_by_name("gpuflow").experiment_id])
    assert len(runs) == 4 and {r.info.status for r in runs} == {"FINISHED"}

    # the registered model, from another folder, through the HTTP server alone
    version = outs[0]["model_version"]
    loaded = _load_elsewhere(stack, tmp_path / "elsewhere", version)
    assert loaded == [2, 10]

    stack.stop()
    assert subprocess.run(["pgrep", "-f", f"postgres -D {stack.data}"], capture_output=True).returncode == 1
    stack.start()
    client = mlflow.MlflowClient(stack.ui)
    again = client.search_runs([client.get_experiment_by_name("gpuflow").experiment_id])
    assert {r.info.run_id for r in again} == {r.info.run_id for r in runs}
    assert _load_elsewhere(stack, tmp_path / "after-restart", version) == [2, 10]  # artifacts kept
    assert _nightly_schedule(stack) == "0 2 * * *"  # the served deployments' schedules kept


def _scheduled(stack: Stack, name: str, parameters: dict, timeout: float = 300):
    """A run of `name` scheduled a few seconds ahead, waited for until it ends."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.settings import temporary_settings

    with temporary_settings(stack.prefect_settings()):
        deadline = time.monotonic() + timeout
        with get_client(sync_client=True) as client:
            while True:  # `gpuflow serve` has registered its deployments
                try:
                    client.read_deployment_by_name(name)
                    break
                except Exception:
                    assert time.monotonic() < deadline
                    time.sleep(1)
        when = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=3)
        flow_run = run_deployment(name, parameters=parameters, scheduled_time=when, timeout=0, as_subflow=False)
        with get_client(sync_client=True) as client:
            while not (state := client.read_flow_run(flow_run.id).state).is_final():
                assert time.monotonic() < deadline, state
                time.sleep(1)
            return client.read_flow_run(flow_run.id)


def _load_elsewhere(stack: Stack, folder: Path, version: str) -> list[int]:
    folder.mkdir()
    code = ("import json, mlflow, numpy as np\n"
            f"m = mlflow.pyfunc.load_model('models:/gpuflow-model/{version}')\n"
            "print(json.dumps(list(m.predict(np.zeros((2, 1, 28, 28), dtype=np.float32)).shape)))\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=folder, env=stack.env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _nightly_schedule(stack: Stack) -> str:
    from prefect.client.orchestration import get_client
    from prefect.settings import temporary_settings

    with temporary_settings(stack.prefect_settings()), get_client(sync_client=True) as client:
        (schedule,) = client.read_deployment_by_name("retrain/nightly").schedules
        return schedule.schedule.cron


def test_a_sweep_on_the_stack_keeps_its_study_in_the_stacks_postgresql(stack, tmp_path):
    import optuna
    from optuna.trial import TrialState

    (tmp_path / "space.yaml").write_text("lr: {type: float, low: 1.0e-3, high: 0.1, log: true}\n")
    p = subprocess.run([str(BIN / "gpuflow"), "sweep", "--space", str(tmp_path / "space.yaml"), "--trials", "2",
                        "--parallel", "1", "--pruner", "none", "--study", "on-the-stack", "--experiment", "swept",
                        "--registered-model", "swept", *TINY], cwd=tmp_path, env=stack.env(), capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not (tmp_path / "optuna.db").exists()  # not beside the user: in the stack's database
    url = f"postgresql+psycopg://gpuflow@/optuna?host={stack.data / 'socket'}"
    study = optuna.load_study(study_name="on-the-stack", storage=url)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    client = mlflow.MlflowClient(stack.ui)
    runs = client.search_runs([client.get_experiment_by_name("swept").experiment_id])
    assert len(runs) == 3 and {r.info.status for r in runs} == {"FINISHED"}
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert urllib.parse.unquote(parent.data.tags["sweep.storage"]) == url
    assert {t.user_attrs["mlflow_run_id"] for t in study.trials} == {
        r.info.run_id for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}


def test_runs_started_together_on_the_stack_all_link_the_same_dataset(stack, tmp_path):
    # The same race as on SQLite (tests/test_tracking_store.py), where PostgreSQL words the
    # duplicate row otherwise: three gpuflow runs at once on the stack failed on it in CI.
    from tests.test_tracking_store import assert_linked_once, start_together

    errors = start_together(stack.ui, "race", tmp_path / "runs", n=8)
    assert not errors, errors
    client = mlflow.MlflowClient(stack.ui)
    assert_linked_once(client.search_runs([client.get_experiment_by_name("race").experiment_id]), 8)


@pytest.fixture
def stranger():
    """A throwaway unix account, removed afterwards: another user of the stack's machine."""
    if os.geteuid() != 0 or not shutil.which("useradd"):
        pytest.skip("making a second unix account needs root and useradd")
    name = f"gpuflow-t{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def _as(user: str, *cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", user, "--", *cmd], capture_output=True, text=True, timeout=60, cwd="/")


def test_another_account_gets_neither_the_database_nor_the_files_nor_the_servers(stack, stranger):
    for role in ("postgres", "gpuflow"):
        p = _as(stranger, "psql", "-h", str(stack.data / "socket"), "-U", role, "-d", "mlflow", "-c", "SELECT 1")
        assert p.returncode != 0, p.stdout
    for path in (stack.data / "credentials.env", stack.data / "artifacts", stack.data / "prefect"):
        assert _as(stranger, "ls", str(path)).returncode != 0, path
    kept = [*stack.data.iterdir(), *(stack.data / "artifacts").rglob("*")]
    assert [p for p in kept if p.stat().st_mode & 0o077] == []  # the stack's account's alone, whatever reaches them

    # both servers, without credentials: 401, an artifact upload included; with them: answered
    curl = ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}"]
    artifact = f"{stack.ui}/api/2.0/mlflow-artifacts/artifacts/0/run/artifacts/checkpoints/epoch-0001.pt"
    asked = {"prefect": [stack.api + PREFECT_PROBE], "mlflow": [stack.ui + MLFLOW_PROBE],
             "artifact get": [artifact], "artifact put": ["-X", "PUT", "--data-binary", "x", artifact]}
    assert {k: _as(stranger, *curl, *args).stdout for k, args in asked.items()} == dict.fromkeys(asked, "401")
    assert stack.answers() == {"prefect": 200, "mlflow": 200}


def test_the_stack_runs_its_two_servers_and_its_database_and_no_mlflow_job_system(stack):
    """MLflow's server would start a job system for its GenAI features (7 huey consumer processes,
    ~2 GB together); gpuflow uses none of it, and on a small machine it took the CPU calls need."""
    tree = [p.cmdline() for p in psutil.Process(stack.proc.pid).children(recursive=True)]
    assert not [c for c in tree if any("huey" in part or "_job_runner" in part for part in c)], tree
    assert any("mlflow" in c and "server" in c for c in tree) and any("prefect" in " ".join(c) for c in tree), tree


def test_the_stacks_start_shows_none_of_its_libraries_deprecation_or_experimental_warnings(stack):
    said = stack.output()
    assert "ready" in said and "Warning" not in said and "experimental" not in said, said[-3000:]


def test_a_terminals_ctrl_c_reaches_the_stack_and_its_servers_but_not_its_postgresql(stack):
    """Ctrl-C goes to the terminal's foreground process group: PostgreSQL, in a session of its own, is stopped by
    the stack after the servers (stopped first, it made Prefect's services log a traceback per query)."""
    group = os.getpgid(stack.proc.pid)
    servers = psutil.Process(stack.proc.pid).children(recursive=True)
    assert [p for p in servers if "prefect" in " ".join(p.cmdline())] and all(
        os.getpgid(p.pid) == group for p in servers if "postgres" not in " ".join(p.cmdline()))
    assert _pids_of(stack.data) and all(os.getpgid(pid) != group for pid in _pids_of(stack.data))


def test_the_servers_database_role_cannot_run_programs(stack):
    import psycopg
    from prefect.settings import temporary_settings
    from prefect.variables import Variable

    with temporary_settings(stack.prefect_settings()):
        url = urllib.parse.urlsplit(Variable.get(STUDY_VARIABLE))  # the role sweeps and the servers connect as
    host = urllib.parse.parse_qs(url.query)["host"][0]
    with psycopg.connect(host=host, user=url.username, dbname="optuna", autocommit=True) as conn:
        assert conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone() == (False,)
        conn.execute("CREATE TEMP TABLE t (x text)")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("COPY t FROM PROGRAM 'id'")


def test_a_second_stack_on_the_same_folder_refuses_in_one_line_and_the_first_keeps_running(stack):
    p = subprocess.run([str(BIN / "gpuflow"), "stack", "--data", str(stack.data), "--prefect-port", str(free_port()),
                        "--mlflow-port", str(free_port())], env=child_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode != 0
    (line,) = [line for line in (p.stdout + p.stderr).splitlines() if line.strip()]
    assert str(stack.data) in line and "stop it" in line, line
    assert stack.answers() == {"prefect": 200, "mlflow": 200}


def _pids_of(data: Path) -> list[int]:
    p = subprocess.run(["pgrep", "-f", f"postgres -D {data}"], capture_output=True, text=True)
    return [int(pid) for pid in p.stdout.split()]


def _wait_until_free(lock: Path, timeout: float = 90) -> None:
    """Until nothing holds the stack's lock: every process of a stack holds it until it exits."""
    deadline = time.monotonic() + timeout
    with open(lock) as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(f, fcntl.LOCK_UN)
                return
            except BlockingIOError:
                assert time.monotonic() < deadline, "processes of the killed stack are still running"
                time.sleep(0.5)


def _until_no_postgresql(data: Path, which: str) -> None:
    deadline = time.monotonic() + 60
    while _pids_of(data):
        assert time.monotonic() < deadline, f"the {which} stack's PostgreSQL is still running"
        time.sleep(0.5)


def test_kill_9_of_the_stack_leaves_no_postgresql_the_next_start_just_starts_and_ctrl_c_stops_it_in_a_few_lines():
    with own_stack("kill") as s:
        s.start()
        assert _pids_of(s.data)
        os.kill(s.proc.pid, signal.SIGKILL)
        s.proc.wait()
        _until_no_postgresql(s.data, "killed")
        _wait_until_free(s.data / "stack.lock")
        s.start()
        assert s.answers() == {"prefect": 200, "mlflow": 200}
        since = len((s.data.parent / "stack.log").read_bytes())
        os.killpg(s.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C, to the stack's process group
        assert s.proc.wait(120) == 0, s.output(since)[-3000:]
        said = s.output(since)
        assert said.count("\n") < 20 and "Traceback" not in said and "Error" not in said, said[-3000:]
        _until_no_postgresql(s.data, "interrupted")


def test_a_stack_stopped_while_it_starts_ends_quietly_and_leaves_no_postgresql():
    with own_stack("early") as s:
        s.launch()
        deadline = time.monotonic() + 120
        while not _pids_of(s.data):  # its PostgreSQL runs: the servers are yet to start and answer
            assert s.proc.poll() is None and time.monotonic() < deadline, s.output()[-3000:]
            time.sleep(0.2)
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(180) == 0, s.output()[-3000:]
        assert "ready" not in s.output() and "did not start" not in s.output(), s.output()[-3000:]
        _until_no_postgresql(s.data, "stopped")
