"""What a user sees and finds: one line for bad input (also inside the flow), quiet default
output, run names and sources, grouped timings, a described registered version, settings."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import mlflow
import numpy as np
import pytest
from pydantic import ValidationError

from gpuflow.flows.calls import InvalidParameters, admit, validated
from gpuflow.flows import cli
from gpuflow.flows.params import EvaluateParams, InferParams, PipelineParams
from gpuflow.flows.settings import Settings, server_command, ui_command, ui_environment
from gpuflow.tasks.devices.assign import AssignmentError, assign_devices_for
from gpuflow.tasks.devices.probe import read_environment, usable_cpus
from gpuflow.tasks.tracking.results import NOT_COMPARED, OUTCOME_TAG
from tests.helpers import ROOT

GPUFLOW = ROOT / ".venv" / "bin" / "gpuflow"

# (parameters, what the one line must name): every rule sits with its parameter's declaration.
BAD = [
    (dict(lr=float("nan")), "lr=nan: Input should be a finite number"),
    (dict(lr=float("inf")), "lr=inf: Input should be a finite number"),
    (dict(epochs=10**30), "Input should be less than or equal to 100000"),
    (dict(epochs=0), "epochs=0: Input should be greater than or equal to 1"),
    (dict(seed=2**40), "seed=1099511627776: Input should be less than or equal to 4294967295"),
    (dict(val_fraction=1.0), "val_fraction=1.0: Input should be less than 1"),
    (dict(rdzv_timeout_s=1), "rdzv_timeout_s=1: Input should be greater than or equal to 10"),
    (dict(dist_timeout_s=0.5), "dist_timeout_s=0.5: Input should be greater than or equal to 10"),
    (dict(experiment="../../outside"), "experiment='../../outside': not a usable name"),
    (dict(experiment="a/b"), "experiment='a/b': not a usable name"),
    (dict(registered_model="it's"), "registered_model=\"it's\": not a usable name"),
    (dict(run_name="x" * 101), "run_name="),
    (dict(tracking_uri="mlflow.db"), "not an MLflow tracking URI; use e.g. sqlite:///"),
    (dict(nnodes=2, rdzv_endpoint="nohost"), "rdzv_endpoint='nohost': not host:port"),
    (dict(node_pool="a.b"), "node_pool='a.b': not a usable name: use up to 100 letters, digits, '_' or '-'"),
]


@pytest.mark.parametrize("values,message", BAD, ids=[next(iter(v)) for v, _ in BAD])
def test_bad_parameters_are_refused_in_one_line_naming_the_value(values, message):
    with pytest.raises(ValidationError) as e:
        PipelineParams(**values)
    line = cli.one_line(e.value)
    assert "\n" not in line and message in line


# What the values ask of the host that runs them: checked in assignment, where the job runs (and by
# the CLI before a server starts), not in validation, which may run on another machine.
TOO_BIG_FOR_THIS_HOST = [
    (dict(cpu_processes=usable_cpus() + 1), f"more than the {usable_cpus()} CPUs this process may use here"),
    (dict(num_workers=usable_cpus() * 4), f"more than the {usable_cpus()} CPUs this process may use here"),
    (dict(dataset="synthetic", synthetic_size=10_000_000, synthetic_side=512), "lower synthetic_size"),
]


@pytest.mark.parametrize("values,message", TOO_BIG_FOR_THIS_HOST, ids=[next(iter(v)) for v, _ in TOO_BIG_FOR_THIS_HOST])
def test_values_too_big_for_this_host_are_refused_by_assignment_in_one_line(values, message):
    params = PipelineParams(**values)  # valid values: another host may have them
    with pytest.raises(AssignmentError) as e:
        assign_devices_for(read_environment(), params, params.batch_size)
    line = cli.one_line(e.value)
    assert "\n" not in line and message in line
    code = cli.main(["run", *[f"--{k.replace('_', '-')}={v}" for k, v in values.items()]])
    assert code == 2  # the CLI refuses them before any server starts


@pytest.mark.parametrize("model,values,message", [
    (EvaluateParams, dict(version="latest"), "version='latest': not a version"),
    (EvaluateParams, dict(version="0"), "version='0': not a version"),
    (EvaluateParams, dict(checkpoint="missing.pt"), "checkpoint='missing.pt': no such file"),
    (InferParams, dict(inputs="missing.pt"), "inputs='missing.pt': no such file"),
])
def test_evaluate_and_infer_refuse_bad_versions_and_missing_files(model, values, message):
    with pytest.raises(InvalidParameters) as e:  # validation reads no file: the door checks them after it
        admit(validated(model, values), values)
    assert message in cli.one_line(e.value)


@pytest.mark.parametrize("args, message", [
    (["sweep", "--space", "s.yaml", "--storage", "notaurl"], "storage='notaurl': not a SQLAlchemy database URL"),
    (["sweep", "--space", "s.yaml", "--study", "my study"], "study='my study': not a usable name: use up to 100 "
     "letters, digits, '.', '_' or '-'"),  # in words, not the regular expression
    (["node", "--pool", "a/b"], "pool='a/b': not a usable name"),
    (["serve", "--retrain-cron", "bad"], "retrain_cron='bad', timezone='UTC': Invalid cron string"),
    (["serve", "--timezone", "Mars/Base"], "No time zone found with key Mars/Base; give a five-field cron"),
])
def test_a_bad_storage_or_schedule_is_one_line_before_anything_starts(tmp_path, args, message):
    (tmp_path / "s.yaml").write_text("lr: {type: float, low: 0.001, high: 0.1}\n")
    out = _gpuflow(args, tmp_path, api="http://127.0.0.1:9/api", timeout=120)  # no server there: none is asked
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().count("\n") == 0 and message in out.stderr, out.stderr[-2000:]


def test_serve_with_no_server_names_the_address_it_tried_and_what_to_start(tmp_path):
    from tests.servers import free_port

    port = free_port()  # nothing listens there
    out = _gpuflow(["serve", "--prefect-port", str(port)], tmp_path, api=None, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"gpuflow serve: the Prefect server at http://127.0.0.1:{port}/api does not answer")
    assert "`gpuflow server`" in line and "PREFECT_API_URL" in line, line


@pytest.mark.parametrize("command, takes, ignores", [
    ("server", "--prefect-port", ["--mlflow-port", "--allow-code", "--retrain-cron"]),
    ("ui", "--mlflow-port", ["--prefect-port", "--allow-paths", "--timezone"]),
    ("serve", "--allow-code", []),
])
def test_a_service_takes_only_the_settings_it_uses(command, takes, ignores):
    p = cli.parser()
    assert cli.parse([command, takes, "1"], p)[0] == command
    for option in ignores:  # refused, not accepted and silently ignored
        with pytest.raises(SystemExit) as e:
            cli.parse([command, option, "1"], p)
        assert e.value.code == 2


def test_good_names_pass():
    p = PipelineParams(experiment="My experiment 2", registered_model="resnet.v2_final-1", run_name="try 3")
    assert (p.experiment, p.run_name) == ("My experiment 2", "try 3")


def _gpuflow(args: list[str], cwd: Path, api: str | None, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_API"))}
    if api:
        env["PREFECT_API_URL"] = api
    return subprocess.run([str(GPUFLOW), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def api_url(prefect_api):
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def test_a_bad_value_on_the_command_line_is_one_line_before_prefect_starts(tmp_path):
    out = _gpuflow(["run", "--lr", "nan", "--experiment", "../x"], tmp_path, api=None)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0, out.stderr
    assert "lr=nan" in out.stderr and "experiment='../x'" in out.stderr
    assert list(tmp_path.iterdir()) == []  # no store, no runs folder


def test_a_refusal_inside_the_flow_is_one_line_with_no_traceback_and_nothing_created(tmp_path, api_url):
    out = _gpuflow(["run", "--gpus", "7,", "--epochs", "1"], tmp_path, api_url)
    assert out.returncode == 2, out.stderr
    message = "gpus=7, asks for GPUs but none are usable"
    assert "Traceback" not in out.stderr and out.stderr.count(message) == 1, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("gpuflow run: " + message)
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "runs").exists()


@pytest.fixture(scope="module")
def default_run(api_url, tmp_path_factory):
    """`gpuflow run` on its defaults (one epoch), as a user starts it, against the session server."""
    cwd = tmp_path_factory.mktemp("user")
    out = _gpuflow(["run", "--epochs", "1"], cwd, api_url)
    assert out.returncode == 0, out.stderr[-3000:]
    mlflow.set_tracking_uri(f"sqlite:///{cwd / 'mlflow.db'}")
    return out, mlflow.MlflowClient()


def test_default_output_is_progress_and_result_only(default_run):
    out, _ = default_run
    for noise in ("Concurrency limits", "OMP_NUM_THREADS", "Warning", "Traceback", "Downloading artifacts",
                  "Successfully registered", "system_metrics", "Creating initial MLflow database"):
        assert noise not in out.stderr, (noise, out.stderr)
    assert "epoch 1/1" in out.stderr and '"status": "FINISHED"' in out.stdout


def test_the_store_file_alone_holds_the_finished_run_and_its_model_version(default_run, tmp_path):
    out, client = default_run
    run_id = json.loads(out.stdout)["run_id"]
    db = Path(client.tracking_uri.removeprefix("sqlite:///"))
    shutil.copyfile(db, tmp_path / "mlflow.db")  # without -wal and -shm, as a backup or a colleague gets it
    copy = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert copy.get_run(run_id).info.status == "FINISHED"
    assert [v.run_id for v in copy.search_model_versions("name='gpuflow-model'")] == [run_id]


def test_runs_are_named_apart_with_the_command_as_source_and_timings_grouped(default_run):
    out, client = default_run
    [run] = client.search_runs([client.get_experiment_by_name("gpuflow").experiment_id])
    name = run.info.run_name
    assert re.fullmatch(r"mlp-digits-[0-9a-f]{6}", name) and run.data.tags["prefect.flow_run_id"].startswith(name[-6:])
    assert run.data.tags["prefect.flow_run_name"] == name  # one name in both UIs, from the flow run's start
    assert f"Flow run '{name}'" in out.stderr and "gpus=auto" not in out.stderr, out.stderr[-3000:]
    assert run.data.tags["mlflow.source.name"] == "gpuflow run"
    timings = [k for k in run.data.metrics if "_s" in k and k.startswith("pipeline")]
    assert timings and all(k.startswith("pipeline/") for k in timings), timings
    assert {"train_loss", "val_loss", "val_accuracy"} <= set(run.data.metrics)


def test_the_registered_version_has_signature_example_description_and_outcome(default_run, tmp_path):
    _, client = default_run
    [version] = client.search_model_versions("name='gpuflow-model'")
    assert version.tags[OUTCOME_TAG] == NOT_COMPARED
    assert "mlp trained on digits" in version.description and "val_accuracy" in version.description
    local = mlflow.artifacts.download_artifacts(f"models:/gpuflow-model/{version.version}", dst_path=str(tmp_path))
    info = mlflow.models.Model.load(local)
    example = info.load_input_example(local)
    assert info.signature is not None and example.shape == (2, 1, 28, 28) and example.dtype == np.float32
    assert example.std() > 0  # real validation samples, not zeros
    scores = mlflow.pyfunc.load_model(local).predict(example)
    assert scores.shape == (2, 10)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--virtual-time-budget=25000", "--window-size=3000,900"]  # wide: the table renders visible columns only


def test_the_experiment_is_a_training_one_and_gpuflow_ui_links_its_runs_with_their_metrics(default_run, tmp_path):
    from tests.servers import ServerProcess, free_port

    _, client = default_run
    exp = client.get_experiment_by_name("gpuflow")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # not a GenAI experiment
    assert json.loads(exp.tags["mlflow.sharedViewState.gpuflow-training"])["name"] == "training runs (gpuflow)"
    folder, port = Path(client.tracking_uri.removeprefix("sqlite:///")).parent, free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")} | {"GPUFLOW_MLFLOW_PORT": str(port)}
    with ServerProcess([str(GPUFLOW), "ui"], f"http://127.0.0.1:{port}/health", env, tmp_path / "ui.log", folder):
        printed = (tmp_path / "ui.log").read_text()
        url = f"http://127.0.0.1:{port}/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning"
        assert f"gpuflow: training runs at {url}&viewStateShareKey=gpuflow-training" in printed, printed
        if not CHROMIUM:
            pytest.skip("chromium is not installed (.ci/run installs Debian's chromium)")
        dom = subprocess.run([CHROMIUM, *CHROME_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom",
                              printed.split("training runs at ")[1].split()[0]],
                             capture_output=True, text=True, timeout=120).stdout
    [run] = client.search_runs([exp.experiment_id])
    assert run.info.run_name in dom and "Sort: val_loss" in " ".join(re.sub("<[^>]+>", " ", dom).split()), dom[-2000:]
    for column in ("val_accuracy", "val_loss", "train_loss"):  # metric columns, not only Source/Models/Dataset
        assert column in dom, column


def test_probe_never_prints_none_and_says_why(capsys):
    report = read_environment()
    cli.print_report(report)
    printed = capsys.readouterr().out
    assert "None" not in printed
    for name in ("driver", "torch", "cuda", "cudnn", "nccl"):
        if getattr(report, f"{name}_version") is None:
            assert report.unknown[name] and f"unknown ({report.unknown[name]}" in " ".join(printed.split())


def test_server_addresses_are_settings_defaulting_to_loopback(monkeypatch):
    s = Settings()
    assert (s.prefect_host, s.prefect_port, s.mlflow_host, s.mlflow_port) == ("127.0.0.1", 4200, "127.0.0.1", 5000)
    assert server_command(s)[-4:] == ["--host", "127.0.0.1", "--port", "4200"]
    monkeypatch.setenv("GPUFLOW_MLFLOW_PORT", "5123")
    monkeypatch.setenv("GPUFLOW_PREFECT_HOST", "10.1.2.3")
    s = Settings()
    assert ui_command(s)[-4:] == ["--host", "127.0.0.1", "--port", "5123"]
    secret = "postgresql+psycopg://u:hunter2@db/mlflow"  # the store goes by environment: `ps` shows no password
    assert secret not in " ".join(ui_command(s)) and ui_environment(secret)["MLFLOW_BACKEND_STORE_URI"] == secret
    assert s.prefect_api_url == "http://10.1.2.3:4200/api"
    for target in ("server", "serve", "ui"):  # the Makefile goes through the settings, not its own values
        assert f".venv/bin/gpuflow {target}\n" in (ROOT / "Makefile").read_text()
