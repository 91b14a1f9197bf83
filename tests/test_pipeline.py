"""The training pipeline flow end to end on CPU: real Prefect API, torchrun, SQLite MLflow."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import mlflow
import pytest
import torch

from gpuflow.flows.params import PipelineParams
from gpuflow.flows.prepared import worker_config
from gpuflow.training import TrainConfig
from gpuflow.training.contract import RunFolder
from gpuflow.flows.train import train_pipeline
from gpuflow.tasks.devices.assign import assign_devices_for
from gpuflow.tasks.launch import launch
from gpuflow.tasks.devices.probe import read_environment
from tests.helpers import ROOT, child_env
from gpuflow.training.checkpoint import load_file
from gpuflow.training.data import load_data
from gpuflow.training.models import SimpleNN

SECRET = "sk-test-gpuflow-secret-do-not-log-4711"
FAST = dict(epochs=2, batch_size=64, dataset="digits", model="mlp")


def _client(store):
    mlflow.set_tracking_uri(store["tracking_uri"])
    return mlflow.MlflowClient()


def _all_artifacts(client, run_id, path=None) -> list[str]:
    out = []
    for f in client.list_artifacts(run_id, path):
        out += _all_artifacts(client, run_id, f.path) if f.is_dir else [f.path]
    return out


@pytest.fixture(scope="module")
def ddp_run(prefect_api, tmp_path_factory):
    base = tmp_path_factory.mktemp("ddp-flow")
    store = {"tracking_uri": f"sqlite:///{base / 'mlflow.db'}", "runs_dir": str(base / "runs")}
    os.environ["GPUFLOW_TEST_SECRET"] = SECRET
    try:
        out = train_pipeline(**FAST, strategy="ddp", gpus="cpu", experiment="e2e", **store)
    finally:
        os.environ.pop("GPUFLOW_TEST_SECRET")
    return out, store


def test_ddp_flow_logs_exactly_one_finished_run_with_everything(ddp_run):
    out, store = ddp_run
    client = _client(store)
    runs = client.search_runs([client.get_experiment_by_name("e2e").experiment_id])
    assert len(runs) == 1 and runs[0].info.run_id == out["run_id"]
    run = runs[0]
    assert run.info.status == "FINISHED" and out["world_size"] == 2
    hist = client.get_metric_history(out["run_id"], "val_accuracy")
    assert sorted(m.step for m in hist) == [1, 2]  # one point per epoch, no duplicates
    for key in ("train_loss", "val_loss", "samples_per_s", "epoch_time_s", "lr"):
        assert len(client.get_metric_history(out["run_id"], key)) == 2, key
    assert any(k.startswith("system/cpu") for k in run.data.metrics)
    tags = run.data.tags
    assert tags["strategy"] == "ddp" and tags["world_size"] == "2" and tags["prefect.flow_run_id"]
    assert tags["physical_gpus"] == "none" and "mlflow.source.git.commit" in tags
    assert run.data.params["epochs"] == "2" and run.data.params["model"] == "mlp"
    assert [d.dataset.name for d in run.inputs.dataset_inputs] == ["digits"]
    arts = _all_artifacts(client, out["run_id"])
    for expected in ("environment/environment_report.json", "environment/device_plan.json",
                     "checkpoints/epoch-0002.pt", "training/result.json",
                     "training/config.json"):
        assert expected in arts, (expected, arts)
    versions = client.search_model_versions(f"name='gpuflow-model' and run_id='{out['run_id']}'")
    assert [str(v.version) for v in versions] == [str(out["model_version"])]


def test_logged_checkpoint_loads_into_plain_mlp_and_reproduces_val_accuracy(ddp_run, tmp_path):
    out, store = ddp_run
    client = _client(store)
    path = client.download_artifacts(out["run_id"], "checkpoints/epoch-0002.pt", str(tmp_path))
    model = SimpleNN()  # built the seeds' way
    model.load_state_dict(load_file(path)["model"], strict=True)
    val = load_data(TrainConfig(**FAST)).val
    with torch.no_grad():
        acc = (model(val.x).argmax(1) == val.y).float().mean().item()
    logged = client.get_run(out["run_id"]).data.metrics["val_accuracy"]
    assert acc == pytest.approx(logged, abs=1e-6)
    assert logged > 0.85


def test_registered_model_loads_as_pyfunc_and_predicts_what_the_checkpoint_does(ddp_run, tmp_path):
    out, store = ddp_run
    client = _client(store)
    model = mlflow.pyfunc.load_model(f"models:/gpuflow-model/{out['model_version']}")
    # the built-in class from the model's own code (gpuflow's models file ships with it)
    net = model.unwrap_python_model().model
    assert (type(net).__name__, type(net).__module__) == ("SimpleNN", "gpuflow_builtin_models")
    val = load_data(TrainConfig(**FAST)).val
    scores = model.predict(val.x[:32].numpy())
    path = client.download_artifacts(out["run_id"], "checkpoints/epoch-0002.pt", str(tmp_path))
    plain = SimpleNN()
    plain.load_state_dict(load_file(path)["model"], strict=True)
    with torch.no_grad():
        assert (scores.argmax(1) == plain(val.x[:32]).argmax(1).numpy()).all()
    sig = model.metadata.signature
    assert sig.inputs.inputs[0].shape == (-1, 1, 28, 28) and sig.outputs.inputs[0].shape == (-1, 10)


def test_no_environment_secret_reaches_mlflow(ddp_run, tmp_path):
    out, store = ddp_run
    client = _client(store)
    run = client.get_run(out["run_id"])
    assert SECRET not in repr(run.data.params) + repr(run.data.tags)
    local = client.download_artifacts(out["run_id"], "", str(tmp_path))
    for f in Path(local).rglob("*"):
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f


def test_single_strategy_flow(prefect_api, store):
    out = train_pipeline(**FAST, strategy="single", gpus="cpu", **store)
    client = _client(store)
    run = client.get_run(out["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["world_size"] == "1"
    assert out["epochs_run"] == 2 and out["strategy"] == "single"


def test_failing_child_fails_flow_and_marks_run_failed_with_its_output(prefect_api, store, monkeypatch):
    monkeypatch.setenv("GPUFLOW_FAULT", "rank=0,epoch=1,restart=0,step=2")
    with pytest.raises(Exception, match="injected fault at epoch 1 step 2"):
        train_pipeline(**FAST, strategy="single", gpus="cpu", experiment="fails", **store)
    client = _client(store)
    runs = client.search_runs([client.get_experiment_by_name("fails").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FAILED"
    assert "injected fault" in runs[0].data.tags["error"]


def test_bad_parameters_are_refused_before_any_run_starts(prefect_api, store):
    with pytest.raises(Exception, match="unknown model 'vgg'"):
        train_pipeline(model="vgg", **store)
    with pytest.raises(Exception, match="fp16"):
        train_pipeline(precision="fp16", gpus="cpu", **store)
    assert not Path(store["tracking_uri"].removeprefix("sqlite:///")).exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_one_host_train_together_into_one_run(prefect_api, store, tmp_path):
    endpoint = f"127.0.0.1:{_free_port()}"
    common = dict(**FAST, gpus="cpu", cpu_processes=1, nnodes=2, rdzv_endpoint=endpoint)
    # node 1: the same launch code the flow uses, in a thread, joining node 0's rendezvous
    p1 = PipelineParams(**common, node_rank=1, runs_dir=str(tmp_path / "node1"))
    plan = assign_devices_for(read_environment(with_torch=False), p1, p1.batch_size)
    work = tmp_path / "node1"
    work.mkdir()
    cfg = worker_config(p1, plan, folder=RunFolder(work)).to_json(work / "config.json")
    errors: list[BaseException] = []

    def node1():
        import logging

        try:
            launch(cfg, plan, p1, work, logging.getLogger("node1"))
        except BaseException as e:  # surfaced by the assert below
            errors.append(e)

    t = threading.Thread(target=node1)
    t.start()
    out = train_pipeline(**common, node_rank=0, **store)
    t.join(timeout=300)
    assert not errors, errors
    assert out["world_size"] == 2
    client = _client(store)
    runs = client.search_runs([client.get_experiment_by_name("gpuflow").experiment_id])
    assert len(runs) == 1 and runs[0].data.tags["world_size"] == "2"
    assert len(client.get_metric_history(out["run_id"], "val_loss")) == 2


def test_readme_main_command_on_a_fresh_copy_writes_a_finished_run(tmp_path):
    """`make run` in a fresh copy of the tree: ephemeral Prefect API, mlflow.db at the top."""
    clone = tmp_path / "clone"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (clone / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, clone / f)
    (clone / ".venv").symlink_to(ROOT / ".venv")
    (tmp_path / "tmp").mkdir()
    env = child_env(PREFECT_HOME=str(tmp_path / "prefect-home"), TMPDIR=str(tmp_path / "tmp"))
    for k in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI"):
        env.pop(k, None)
    proc = subprocess.run(["make", "-o", ".venv/.installed", "run", "ARGS=--epochs 2"], cwd=clone,
                          env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not list((tmp_path / "tmp").glob("torchelastic_*"))  # torchrun's folders are in the run's, not /tmp
    db = clone / "mlflow.db"
    assert db.is_file()
    mlflow.set_tracking_uri(f"sqlite:///{db}")
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert [r.info.status for r in runs] == ["FINISHED"]
    assert '"status": "FINISHED"' in proc.stdout
    # The run's params are the config the worker ran, field for field, plus the launch's settings.
    params = runs[0].data.params
    config = json.loads((clone / "runs" / runs[0].info.run_id / "config.json").read_text())
    assert config["epochs"] == 2 and config["device"] == "cpu"
    assert config["checkpoint_dir"] == str(clone / "runs" / runs[0].info.run_id / "checkpoints")
    for k, v in config.items():
        assert params[k] == (json.dumps(v) if isinstance(v, list) else str(v)), k
    assert params["gpus"] == "auto" and params["world_size"] == "2" and params["nnodes"] == "1" and params["nodes"] == "1"
    assert set(params) - set(config) == {"gpus", "world_size", "nodes", "nnodes", "nproc_per_node", "backend",
                                         "min_free_mb", "skip_busy", "cpu_processes", "cpu_cores", "max_restarts",
                                         "launch_retries", "rdzv_timeout_s", "max_node_failures", "min_nodes"}


def test_a_flow_runs_source_is_read_from_the_api_once_however_many_jobs_ask(prefect_api, monkeypatch):
    """A sweep asks for its run's tags and the door's policy at every trial. Prefect's `deployment.get_id` reads the
    flow run from the API at each call (there were 3 reads per trial, each waiting on the flow's event loop)."""
    import prefect.runtime.deployment as runtime_deployment
    from prefect import flow
    from prefect.runtime import flow_run

    from gpuflow.flows import allow, session
    from gpuflow.tasks.tracking.store import FLOW_RUN_TAG

    reads, read = [], runtime_deployment._get_flow_run

    async def counted(run_id):
        reads.append(str(run_id))
        return await read(run_id)

    monkeypatch.setattr(runtime_deployment, "_get_flow_run", counted)

    @flow
    def asks():
        return [session.run_tags() for _ in range(3)], [allow.current_policy() for _ in range(3)], flow_run.get_id()

    for _ in range(2):  # two flow runs: each reads its own, once
        tags, policies, run_id = asks()
        assert reads.count(run_id) == 1 and len(set(reads)) == len(reads), reads
        assert all(t == tags[0] for t in tags) and tags[0][FLOW_RUN_TAG] == run_id
        assert tags[0]["prefect.deployment"] is None and policies == [None] * 3  # no deployment: a local run
    assert len(reads) == 2
