"""Commands started together on one machine: each `gpuflow run` or `evaluate` without
PREFECT_API_URL starts a temporary Prefect API on a PREFECT_HOME of its own, from the template
database kept in the user's PREFECT_HOME; all of them work, even on a fresh PREFECT_HOME where
every one of them migrates a database and writes the template at once, and none of them leaves
a flow run in the user's PREFECT_HOME."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

from gpuflow.flows.api import template_path
from gpuflow.tasks.tracking.store import open_store  # under gpuflow's lock: a run may be creating the file
from tests.helpers import child_env

RUNS = 3
APIS = 4  # temporary APIs alone are light: more of them at once, so a race shows on every try
HANG_GUARD_S = 540  # a run that takes longer is a hang, not a slow start
# One flow through the temporary API a `gpuflow` command starts, as `gpuflow evaluate` does.
ONE_FLOW = """
from prefect import flow
from gpuflow.flows.api import prefect_api

@flow(flow_run_name="{name}")
def hello() -> int:
    return 1

with prefect_api():
    hello()
"""


def start_run(folder: Path, name: str, env: dict) -> subprocess.Popen:
    """The smallest `gpuflow run`, in the folder every run shares (one mlflow.db), its messages in name.log."""
    cmd = [sys.executable, "-m", "gpuflow.flows", "run", "--epochs", "1", "--gpus", "cpu",
           "--cpu-processes", "1", "--run-name", name]
    return subprocess.Popen(cmd, cwd=folder, env=env, stdout=subprocess.DEVNULL,
                            stderr=open(folder / f"{name}.log", "w"), start_new_session=True)


def run_states(folder: Path) -> dict[str, str]:
    client = open_store(f"sqlite:///{folder / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return {r.info.run_name: r.info.status for r in runs}


def wait_all(procs: list[subprocess.Popen]) -> list[int]:
    try:
        return [p.wait(HANG_GUARD_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def left_in(prefect_home: Path) -> list[str]:
    """What the commands left in the user's PREFECT_HOME: the template only (a usable, migrated database)."""
    (template,) = (prefect_home / "gpuflow").iterdir()
    with sqlite3.connect(template) as db:
        assert db.execute("select count(*) from flow_run").fetchone() == (0,)
    return sorted(str(p.relative_to(prefect_home)) for p in prefect_home.rglob("*") if p.is_file())


def test_runs_started_together_on_a_fresh_prefect_home_all_finish(tmp_path):
    env = child_env(PREFECT_HOME=str(tmp_path / "ph"))
    env.pop("PREFECT_API_URL", None)
    names = [f"run{i}" for i in range(RUNS)]
    codes = wait_all([start_run(tmp_path, name, env) for name in names])
    assert codes == [0] * RUNS, {n: (tmp_path / f"{n}.log").read_text()[-3000:] for n, c in zip(names, codes) if c}
    assert run_states(tmp_path) == {n: "FINISHED" for n in names}
    assert left_in(tmp_path / "ph") == [f"gpuflow/{template_path().name}"]


def test_temporary_apis_started_together_on_a_fresh_prefect_home_all_serve(tmp_path):
    env = child_env(PREFECT_HOME=str(tmp_path / "ph"))
    env.pop("PREFECT_API_URL", None)
    logs = [tmp_path / f"api{i}.log" for i in range(APIS)]
    codes = wait_all([subprocess.Popen([sys.executable, "-c", ONE_FLOW.format(name=log.stem)], cwd=tmp_path,
                                       env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"),
                                       start_new_session=True) for log in logs])
    assert codes == [0] * APIS, {log.stem: log.read_text()[-3000:] for log, c in zip(logs, codes) if c}
    assert left_in(tmp_path / "ph") == [f"gpuflow/{template_path().name}"]
