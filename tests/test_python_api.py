"""gpuflow's flows called from a Prefect user's own flow (gpuflow.flows: train_pipeline and
prefect_api), and what every caller gets: one-line refusals, quiet MLflow, a prompt stop on
Ctrl-C, and a command that ends when its Prefect API is lost, with no registered version
pointing at a run that did not finish."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlflow
import psutil
import pytest

from gpuflow.flows.calls import INTERRUPTED
from gpuflow.training.errors import UserError
from tests.helpers import child_env
from tests.servers import prefect_server

USER_FLOW = """
    import json, sys
    from prefect import flow
    from gpuflow.flows import prefect_api, train_pipeline

    @flow
    def my_flow(epochs: int, samples: int):
        out = train_pipeline(model="mlp", dataset="synthetic", synthetic_size=samples, epochs=epochs,
                             gpus="cpu", strategy="single", tracking_uri="sqlite:///{db}", runs_dir="{runs}")
        return out["status"], out["model_version"]

    if __name__ == "__main__":
        with prefect_api():
            print(json.dumps(my_flow(epochs=int(sys.argv[1]), samples=int(sys.argv[2]))))
"""


def user_flow(base: Path) -> Path:
    f = base / "my_flow.py"
    f.write_text(textwrap.dedent(USER_FLOW).format(db=base / "mlflow.db", runs=base / "runs"))
    return f


def start_user_flow(base: Path, *args: str) -> subprocess.Popen:
    """The user's script, as a shell starts a foreground job: its own group, SIGINT handled
    (a `&` job would inherit it ignored), no PREFECT_API_URL."""
    (base / "tmp").mkdir(exist_ok=True)
    env = child_env(PREFECT_HOME=str(base / "ph"), TMPDIR=str(base / "tmp"))
    env.pop("PREFECT_API_URL", None)
    reset = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    return subprocess.Popen([sys.executable, "-c", reset, str(user_flow(base)), *args], cwd=base, env=env,
                            stdout=subprocess.PIPE, stderr=open(base / "err.log", "w"), text=True,
                            start_new_session=True)


def runs(db: Path) -> list:
    client = mlflow.MlflowClient(f"sqlite:///{db}")
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def temporary_homes(base: Path) -> list[Path]:
    """The private PREFECT_HOMEs of gpuflow's temporary APIs (flows/api.py) left in the flow's TMPDIR."""
    return list((base / "tmp").glob("gpuflow-prefect-*"))


def test_a_users_flow_trains_through_the_python_api_quietly_and_stops_on_ctrl_c(tmp_path):
    done = start_user_flow(tmp_path, "1", "256")
    out, _ = done.communicate(timeout=300)
    err = (tmp_path / "err.log").read_text()
    assert done.returncode == 0, err[-3000:]
    assert out.strip().splitlines()[-1] == '["FINISHED", "1"]'
    assert "INFO mlflow" not in err and "Downloading artifacts" not in err, err[-3000:]  # as quiet as the CLI
    assert "Prefect's own temporary API" not in err  # prefect_api() gave it gpuflow's

    first = set((tmp_path / "runs").glob("*/metrics.jsonl"))
    stopped = start_user_flow(tmp_path, "200", "20000")
    deadline = time.monotonic() + 300
    while not set((tmp_path / "runs").glob("*/metrics.jsonl")) - first or len(runs(tmp_path / "mlflow.db")) < 2:
        assert stopped.poll() is None and time.monotonic() < deadline, (tmp_path / "err.log").read_text()[-3000:]
        time.sleep(0.5)
    tree = [psutil.Process(stopped.pid), *psutil.Process(stopped.pid).children(recursive=True)]
    (metrics,) = set((tmp_path / "runs").glob("*/metrics.jsonl")) - first
    os.killpg(stopped.pid, signal.SIGINT)
    epochs_then = len(metrics.read_text().splitlines())
    stopped.wait(120)
    epochs_after = len(metrics.read_text().splitlines()) - epochs_then
    assert epochs_after <= 1, f"{epochs_after} epochs trained after Ctrl-C: a user's flow stops its training at once"
    err = (tmp_path / "err.log").read_text()
    assert "Traceback" not in err and err.strip().splitlines()[-1] == INTERRUPTED, err[-3000:]  # one line
    _, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, [p.cmdline()[:4] for p in alive]
    statuses = sorted(r.info.status for r in runs(tmp_path / "mlflow.db"))
    assert statuses == ["FINISHED", "KILLED"], statuses
    assert not temporary_homes(tmp_path)  # its temporary API's home went with it: no flow run left anywhere
    assert not (tmp_path / "ph" / "prefect.db").exists()  # the user's own PREFECT_HOME holds no flow run of it


def test_bad_values_are_refused_in_one_line_whoever_calls_the_flow():
    from gpuflow.flows import InvalidParameters, train_pipeline

    with pytest.raises(InvalidParameters) as e:
        train_pipeline.fn(epochs=0, batch_size=-3)
    assert isinstance(e.value, UserError)
    assert str(e.value) == ("epochs=0: Input should be greater than or equal to 1; "
                            "batch_size=-3: Input should be greater than or equal to 1")


def test_a_misspelled_keyword_is_refused_in_one_line_with_the_name_meant_before_prefect_binds_it():
    from gpuflow.flows import InvalidParameters, sweep, train_pipeline

    with pytest.raises(InvalidParameters) as e:
        train_pipeline(epoch=3, gpus="cpu")  # Prefect's ParameterBindError: 2,400 characters, four times
    assert str(e.value) == "epoch=3: train_pipeline takes no parameter 'epoch'; did you mean epochs?"
    with pytest.raises(InvalidParameters, match=r"^zzz=1: sweep takes no parameter 'zzz'$"):
        sweep(zzz=1)


def test_a_flow_on_prefects_own_temporary_api_says_how_to_avoid_it(monkeypatch, capsys):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from gpuflow.flows.calls import warn_on_prefects_temporary_api

    with temporary_settings(updates={PREFECT_API_URL: None}):
        warn_on_prefects_temporary_api()
    assert "with gpuflow.flows.prefect_api():" in capsys.readouterr().err
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:1/api"}):
        warn_on_prefects_temporary_api()
    assert capsys.readouterr().err == ""


HEARTBEAT_FLOW = """
    from prefect import flow
    from prefect.settings import get_current_settings
    from gpuflow.flows.api import prefect_api, temporary_api

    @flow
    def beats():
        return get_current_settings().flows.heartbeat_frequency

    api = temporary_api()  # as the CLI does: started before the flow's imports, used by prefect_api
    with prefect_api(api) as url:
        print(url == api.url, beats())
"""


def test_a_temporary_api_started_early_is_the_one_used_and_its_flow_runs_send_no_heartbeats(tmp_path, prefect_api):
    """The CLI starts its temporary API before the flow's imports and enters it later: one server. It runs no
    services (nothing reads heartbeats) and ends with the command: a flow's end must not wait for Prefect's
    heartbeat thread there. A configured server keeps them (zombie detection)."""
    from prefect import flow
    from prefect.settings import get_current_settings

    from gpuflow.flows import prefect_api as api

    env = child_env(PREFECT_HOME=str(tmp_path / "ph"))
    env.pop("PREFECT_API_URL", None)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(HEARTBEAT_FLOW)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", "None"], out.stdout
    assert out.stderr.count("starting a temporary Prefect API") == 1, out.stderr[-3000:]  # the one started

    @flow
    def beats():
        return get_current_settings().flows.heartbeat_frequency

    with api() as url:
        assert url is None  # the test's configured server
        assert beats() == get_current_settings().flows.heartbeat_frequency == 180  # Prefect's default


def test_gpuflow_flows_imports_neither_prefect_nor_mlflow_until_used():
    code = ("import sys, gpuflow.flows as f; assert 'prefect' not in sys.modules and 'mlflow' not in sys.modules; "
            "f.train_pipeline; assert 'prefect' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_lost_prefect_api_ends_the_command_and_leaves_no_version_of_an_unfinished_run(tmp_path):
    """The API dies as training ends (before or during the registration): the command ends
    with one line naming it, and the model registry holds no version of the failed run."""
    (tmp_path / "home").mkdir()
    server, url = prefect_server(tmp_path / "home")
    db = tmp_path / "mlflow.db"
    with server:
        env = child_env(PREFECT_API_URL=url, PREFECT_HOME=str(tmp_path / "home"), PREFECT_CLIENT_MAX_RETRIES="1")
        cmd = [sys.executable, "-m", "gpuflow.flows", "run", "--dataset", "synthetic", "--synthetic-size", "512",
               "--epochs", "2", "--gpus", "cpu", "--tracking-uri", f"sqlite:///{db}", "--runs-dir",
               str(tmp_path / "runs")]
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                                stderr=open(tmp_path / "err.log", "w"), start_new_session=True)
        deadline = time.monotonic() + 300
        while not list((tmp_path / "runs").glob("*/result.json")):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "err.log").read_text()[-3000:]
            time.sleep(0.02)
        os.killpg(server.proc.pid, signal.SIGKILL)
        start = time.monotonic()
        code = proc.wait(300)
        took = time.monotonic() - start
    err = (tmp_path / "err.log").read_text()
    assert code == 1 and took < 120, (took, err[-3000:])
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"gpuflow run: the Prefect API at {url} stopped answering"), last
    (run,) = runs(db)
    assert run.info.status == "FAILED" and "stopped answering" in run.data.tags["error"]
    versions = mlflow.MlflowClient(f"sqlite:///{db}").search_model_versions(f"run_id='{run.info.run_id}'")
    assert versions == [], "a registered version points at a FAILED run"


def test_a_run_that_fails_after_registering_withdraws_its_version(tmp_path):
    from gpuflow.tasks.tracking import tracked

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(RuntimeError, match="after the registration"):
        with tracked.tracked_run(uri, "exp", "r", {}, None, tmp_path / "runs") as run:
            run.client.create_registered_model("m")
            run.client.create_model_version("m", f"runs:/{run.run_id}/model", run.run_id)
            raise RuntimeError("a step after the registration failed")
    client = mlflow.MlflowClient(uri)
    (finished,) = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert finished.info.status == "FAILED"
    assert client.search_model_versions("name='m'") == []
    assert finished.data.tags["gpuflow.withdrawn_versions"] == "m v1"
