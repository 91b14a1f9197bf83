"""Deployments, retraining, inference and the MLflow UI, against real servers on loopback."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request

import mlflow
import pytest

from gpuflow.flows.infer import evaluate_model
from gpuflow.flows.retrain import retrain
from gpuflow.flows.train import train_pipeline
from gpuflow.tasks.tracking.results import OUTCOME_TAG
from tests.servers import BIN, mlflow_server

QUICK = dict(epochs=2, dataset="digits", model="mlp", gpus="cpu")


def _prefect(args: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "prefect"), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def retrained(prefect_api, tmp_path_factory):
    """Retrain twice against one store: a good first model, then a worse challenger (1 epoch,
    tiny learning rate) that must not take the champion alias."""
    base = tmp_path_factory.mktemp("retrain")
    store = dict(tracking_uri=f"sqlite:///{base / 'mlflow.db'}", runs_dir=str(base / "runs"))
    first = retrain(**QUICK, **store)
    second = retrain(**{**QUICK, "epochs": 1}, lr=1e-6, **store)
    return base, store, first, second


def test_first_retrain_promotes_and_a_worse_challenger_does_not(retrained):
    _, store, first, second = retrained
    assert first["promoted"] and first["retrain.champion_version"] == "none"
    mlflow.set_tracking_uri(store["tracking_uri"])
    client = mlflow.MlflowClient()
    champion = client.get_model_version_by_alias("gpuflow-model", "champion")
    assert not second["promoted"] and second["retrain.decision"] == "kept champion"
    assert str(champion.version) == first["retrain.challenger_version"]
    assert float(second["retrain.challenger_score"]) < float(second["retrain.champion_score"])
    tags = client.get_run(second["run_id"]).data.tags
    assert tags["retrain.decision"] == "kept champion" and tags["retrain.champion_version"] == "1"
    outcomes = {str(v.version): v.tags[OUTCOME_TAG] for v in client.search_model_versions("name='gpuflow-model'")}
    assert outcomes[first["retrain.challenger_version"]].startswith("promoted: accuracy ")
    assert re.fullmatch(r"rejected: accuracy 0\.\d{4} <= champion v1 0\.\d{4}",
                        outcomes[second["retrain.challenger_version"]]), outcomes
    versions = client.search_model_versions("name='gpuflow-model'")
    assert sorted(int(v.version) for v in versions) == [1, 2]  # one version per run


def test_inference_on_a_chosen_device_reproduces_the_logged_accuracy(retrained):
    _, store, first, _ = retrained
    out = evaluate_model(version="champion", gpus="cpu", tracking_uri=store["tracking_uri"])
    mlflow.set_tracking_uri(store["tracking_uri"])
    logged = mlflow.MlflowClient().get_run(first["run_id"]).data.metrics["val_accuracy"]
    assert out["version"] == "1" and out["device"] == "cpu" and out["samples"] == 359
    assert out["accuracy"] == pytest.approx(logged, abs=1e-6)


def test_gpuflow_evaluate_and_infer_use_the_champion_on_the_named_device(retrained, tmp_path):
    import torch

    from gpuflow.training import TrainConfig
    from gpuflow.training.data import load_data

    base, store, first, _ = retrained
    env = dict(os.environ, MLFLOW_TRACKING_URI=store["tracking_uri"], PREFECT_HOME=str(tmp_path / "ph"))
    env.pop("PREFECT_API_URL", None)
    gpuflow = [sys.executable, "-m", "gpuflow.flows"]
    val = load_data(TrainConfig(**{k: v for k, v in QUICK.items() if k in TrainConfig.model_fields})).val
    torch.save({"inputs": val.x[:5]}, tmp_path / "x.pt")
    proc = subprocess.run([*gpuflow, "infer", "--inputs", str(tmp_path / "x.pt"), "--gpus", "cpu",
                           "--output", str(tmp_path / "pred.json")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pred = json.loads((tmp_path / "pred.json").read_text())
    assert pred["version"] == "1" and pred["device"] == "cpu" and pred["samples"] == 5
    assert len(pred["predictions"]) == 5 and all(abs(sum(p) - 1) < 1e-4 for p in pred["probabilities"])
    assert sum(p == y for p, y in zip(pred["predictions"], val.y[:5].tolist(), strict=True)) >= 3
    three = subprocess.run([*gpuflow, "evaluate", "--gpus", "3"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert three.returncode == 2 and "asks for several devices" in three.stderr and "'3,'" in three.stderr


@pytest.mark.gpu
def test_inference_on_a_physical_gpu(retrained):
    from gpuflow.tasks.devices.probe import read_environment

    gpu = read_environment().gpus[-1].index
    _, store, _, _ = retrained
    out = evaluate_model(version="1", gpus=f"{gpu},", tracking_uri=store["tracking_uri"])
    assert out["device"] == "cuda:0" and out["cuda_visible_devices"] == str(gpu)


@pytest.fixture(scope="module")
def mlflow_ui(retrained):
    base, _, first, _ = retrained
    server, url = mlflow_server(base / "mlflow.db", base / "mlflow-server.log")
    with server:
        yield url, first["run_id"]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def test_mlflow_server_serves_the_run_its_history_and_artifacts(mlflow_ui):
    url, run_id = mlflow_ui
    run = _get(f"{url}/api/2.0/mlflow/runs/get?run_id={run_id}")["run"]
    assert run["info"]["status"] == "FINISHED"
    hist = _get(f"{url}/api/2.0/mlflow/metrics/get-history?run_id={run_id}&metric_key=val_accuracy")
    assert [m["step"] for m in hist["metrics"]] == [1, 2]
    arts = _get(f"{url}/api/2.0/mlflow/artifacts/list?run_id={run_id}&path=checkpoints")
    assert [f["path"] for f in arts["files"]] == ["checkpoints/epoch-0002.pt"]


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--virtual-time-budget=25000", "--window-size=1400,900"]


@pytest.mark.skipif(not CHROMIUM, reason="chromium is not installed (.ci/run installs Debian's chromium)")
def test_mlflow_ui_shows_the_run_page_in_a_headless_browser(mlflow_ui, tmp_path):
    url, run_id = mlflow_ui
    run = _get(f"{url}/api/2.0/mlflow/runs/get?run_id={run_id}")["run"]
    page = f"{url}/#/experiments/{run['info']['experiment_id']}/runs/{run_id}"
    profile = ["--user-data-dir=" + str(tmp_path / "profile")]
    dom = subprocess.run([CHROMIUM, *CHROME_FLAGS, *profile, "--dump-dom", page], capture_output=True,
                         text=True, timeout=120).stdout
    assert run["info"]["run_name"] in dom, dom[-2000:]
    shot = tmp_path / "run-page.png"
    subprocess.run([CHROMIUM, *CHROME_FLAGS, *profile, f"--screenshot={shot}", page],
                   capture_output=True, timeout=120)
    assert shot.is_file() and shot.stat().st_size > 10_000


def test_runs_on_one_host_queue_on_the_device_limit_instead_of_training_together(prefect_api, store):
    import threading

    from prefect.client.orchestration import get_client

    from gpuflow.flows.serve import ensure_device_limit

    name = ensure_device_limit()
    errors: list[BaseException] = []

    def one(seed):
        try:
            train_pipeline(**QUICK, strategy="single", seed=seed, **store)
        except BaseException as e:
            errors.append(e)

    try:
        threads = [threading.Thread(target=one, args=(s,)) for s in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
    finally:
        with get_client(sync_client=True) as client:
            client.delete_global_concurrency_limit_by_name(name)
    assert not errors, errors
    mlflow.set_tracking_uri(store["tracking_uri"])
    runs = sorted(mlflow.search_runs(search_all_experiments=True, output_format="list"),
                  key=lambda r: r.info.start_time)
    assert len(runs) == 2 and all(r.info.status == "FINISHED" for r in runs)
    assert runs[0].info.end_time <= runs[1].info.start_time  # the second waited for the first
