"""The team stack (`gpuflow stack`, flows/stack.py) on a real PostgreSQL made by the command in a
temporary folder: Prefect and MLflow servers on it, runs and a scheduled run through them, a
model loaded back through the HTTP server alone, and everything still there after a restart."""

from __future__ import annotations

import datetime
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlflow
import numpy as np
import pytest

from tests.helpers import child_env
from tests.servers import BIN, free_port

pytestmark = pytest.mark.slow

TINY = ["--gpus", "cpu", "--strategy", "single", "--epochs", "1"]


def _postgres_usable() -> str | None:
    if not (shutil.which("initdb") and shutil.which("pg_ctl")):
        return "PostgreSQL's initdb and pg_ctl are not on the PATH"
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

    def start(self) -> None:
        log = open(self.data.parent / "stack.log", "a")
        self.proc = subprocess.Popen([str(BIN / "gpuflow"), "stack", "--data", str(self.data), "--prefect-port",
                                      str(self.ports[0]), "--mlflow-port", str(self.ports[1])], env=child_env(),
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 240
        while "ready" not in (self.data.parent / "stack.log").read_text().split("gpuflow stack:")[-1]:
            assert self.proc.poll() is None, (self.data.parent / "stack.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the stack did not start"
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def env(self, **extra) -> dict:
        return child_env(PREFECT_API_URL=self.api, MLFLOW_TRACKING_URI=self.ui, **extra)


@pytest.fixture(scope="module")
def stack():
    if why := _postgres_usable():
        pytest.skip(why)
    base = Path(tempfile.mkdtemp(prefix="gpuflow-stack-"))  # PostgreSQL's user must reach it: not pytest's 0700 tree
    base.chmod(0o755)
    s = Stack(base / "data")
    try:
        s.start()
        yield s
    finally:
        s.stop()
        subprocess.run(["pkill", "-f", f"postgres -D {s.data}"], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


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
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: stack.api}):
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
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: stack.api}), get_client(sync_client=True) as client:
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
    url = f"postgresql+psycopg://postgres@/optuna?host={stack.data / 'socket'}"
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
