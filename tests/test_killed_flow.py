"""A flow killed outright (kill -9, the OOM killer) leaves no MLflow run RUNNING: its watcher
(gpuflow/tasks/tracking/watcher.py) ends it KILLED within DEADLINE_S, with no other gpuflow run started, and then
exits too. Real `gpuflow run`s, on the temporary Prefect API and on a server, and a real SQLite store."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import psutil
import pytest

from gpuflow.tasks.tracking.orphans import OWNER_PID, owner_tags
from gpuflow.tasks.tracking.store import open_store
from gpuflow.tasks.tracking.watcher import DEADLINE_S, POLL_S, RELEASE_WAIT_S, watch_run
from tests.helpers import child_env

WATCHER = "gpuflow.tasks.tracking.watcher"
STARTUP_S = 300  # a run that has not trained an epoch by then is stuck (2 busy cores)
STOP_S = 30  # the reaper's grace (GPUFLOW_STOP_GRACE_S) and then some: the ranks are gone by then
WATCHER_MAX_RSS = 40 * 2**20  # a bare interpreter and the pipe: MLflow alone would be several times this


@pytest.fixture(scope="module")
def api_url(prefect_api):
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def start_training(base: Path, api_url: str | None) -> tuple[subprocess.Popen, Path]:
    """`gpuflow run` of many epochs (long enough to be killed while it trains), on the temporary API or `api_url`."""
    db = base / "mlflow.db"
    cmd = [sys.executable, "-m", "gpuflow.flows", "run", "--dataset", "synthetic", "--synthetic-size", "60000",
           "--epochs", "50", "--gpus", "cpu", "--tracking-uri", f"sqlite:///{db}", "--runs-dir", str(base / "runs")]
    env = child_env(PREFECT_HOME=str(base / "ph"))
    env.pop("PREFECT_API_URL", None)
    if api_url:
        env["PREFECT_API_URL"] = api_url
    proc = subprocess.Popen(cmd, cwd=base, env=env, stdout=subprocess.DEVNULL, stderr=open(base / "err.log", "w"),
                            start_new_session=True)
    return proc, db


def wait_for_first_epoch(proc: subprocess.Popen, db: Path, base: Path) -> None:
    deadline = time.monotonic() + STARTUP_S
    while True:
        try:
            with sqlite3.connect(db, timeout=5) as c:
                if c.execute("select 1 from metrics where key='train_loss'").fetchone():
                    return
        except sqlite3.OperationalError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, (base / "err.log").read_text()[-3000:]
        time.sleep(0.5)


def runs_of(db: Path) -> list:
    client = mlflow.MlflowClient(f"sqlite:///{db}")
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def status_after(db: Path, run_id: str, within_s: float) -> tuple[str, float]:
    """The run's status once it is no longer RUNNING or `within_s` has passed, and the seconds it took."""
    client, start = mlflow.MlflowClient(f"sqlite:///{db}"), time.monotonic()
    while (status := client.get_run(run_id).info.status) == "RUNNING" and time.monotonic() - start < within_s:
        time.sleep(0.2)
    return status, time.monotonic() - start


def holds_no_library(proc: psutil.Process) -> bool:
    """Whether no shared library of an installed package (torch, MLflow's SQLAlchemy, numpy) is mapped in."""
    return "site-packages" not in Path(f"/proc/{proc.pid}/maps").read_text()


@pytest.mark.parametrize("api", ["temporary API", "server"])
def test_kill_9_of_the_flow_ends_its_run_killed_by_its_watcher_without_another_run(api, tmp_path, request):
    api_url = request.getfixturevalue("api_url") if api == "server" else None
    proc, db = start_training(tmp_path, api_url)
    try:
        wait_for_first_epoch(proc, db, tmp_path)
        (run,) = runs_of(db)
        assert run.info.status == "RUNNING" and run.data.tags[OWNER_PID] == str(proc.pid)  # the flow owns it
        tree = psutil.Process(proc.pid).children(recursive=True)
        watchers = [(p.ppid(), " ".join(p.cmdline()), p.memory_info().rss, holds_no_library(p))
                    for p in tree if WATCHER in p.cmdline()]
        proc.send_signal(signal.SIGKILL)  # no finally, no hook of the flow runs
        proc.wait()
        status, took = status_after(db, run.info.run_id, DEADLINE_S + POLL_S + 5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert status == "KILLED", f"still {status} {took:.1f} s after the flow was killed"
    (run,) = runs_of(db)  # nothing else started a run: the watcher marked it
    assert "killed or crashed" in run.data.tags["error"] and "its watcher" in run.data.tags["error"]
    _, alive = psutil.wait_procs(tree, timeout=max(STOP_S, DEADLINE_S + POLL_S - took))
    assert not alive, [p.cmdline()[:4] for p in alive]  # the watcher included
    ((parent, argv, rss, bare),) = watchers  # one, the flow's own child, as it was while the flow lived:
    assert parent == proc.pid and run.info.run_id not in argv and str(db) not in argv  # `ps` shows argv to all
    assert rss < WATCHER_MAX_RSS and bare


def test_a_watcher_told_the_run_ended_leaves_at_once_and_leaves_the_run_alone(store):
    client = open_store(store["tracking_uri"])
    run = client.create_run(client.get_experiment_by_name("Default").experiment_id, tags=owner_tags())
    watcher = watch_run(store["tracking_uri"], run.info.run_id)
    proc = psutil.Process(watcher.proc.pid)
    assert proc.ppid() == psutil.Process().pid and proc.cmdline()[-2:] == ["-m", WATCHER]
    time.sleep(1)  # started and waiting on the pipe
    assert proc.memory_info().rss < WATCHER_MAX_RSS and holds_no_library(proc)
    start = time.monotonic()
    watcher.release()
    assert watcher.proc.returncode == 0 and time.monotonic() - start < RELEASE_WAIT_S
    assert client.get_run(run.info.run_id).info.status == "RUNNING"  # ending it was its owner's business
