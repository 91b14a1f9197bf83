"""Faults and bad input: elastic restarts, retries, concurrency, timeouts, clear errors."""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from pathlib import Path

import mlflow
import pytest
import torch
from pydantic import ValidationError

from gpuflow.flows.cli import one_line
from gpuflow.flows.params import PipelineParams
from gpuflow.flows.prepared import worker_config
from gpuflow.training import TrainConfig
from gpuflow.training.contract import RunFolder
from gpuflow.flows.train import train_pipeline
from gpuflow.tasks.devices.assign import assign_devices_for
from gpuflow.tasks.launch import TrainingFailed, launch
from gpuflow.tasks.devices.probe import EnvironmentReport, GpuInfo, read_environment
from tests.helpers import ROOT, result, run_worker
from gpuflow.training.checkpoint import load_file
from gpuflow.training.models import SimpleNN, SmallCNN

BASE = dict(dataset="synthetic", synthetic_size=640, batch_size=64, model="mlp", epochs=3,
            deterministic=True, seed=11, gpus="cpu")


def _runs(store, experiment="gpuflow"):
    mlflow.set_tracking_uri(store["tracking_uri"])
    c = mlflow.MlflowClient()
    exp = c.get_experiment_by_name(experiment)
    return c, (c.search_runs([exp.experiment_id]) if exp else [])


def test_worker_killed_mid_epoch_is_restarted_by_torchrun_and_run_continues(prefect_api, store, monkeypatch, tmp_path):
    monkeypatch.setenv("GPUFLOW_FAULT", "rank=1,epoch=2,restart=0,step=2")
    out = train_pipeline(**BASE, strategy="ddp", max_restarts=1, **store)
    monkeypatch.delenv("GPUFLOW_FAULT")
    client, runs = _runs(store)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert out["restarts"] == 1 and runs[0].data.tags["torchrun_restarts"] == "1"
    assert out["resumed_from"].endswith("epoch-0001.pt")
    steps = [m.step for m in client.get_metric_history(out["run_id"], "train_loss")]
    assert sorted(steps) == [1, 2, 3]  # epoch 2 logged once, after the restart
    # an uninterrupted run of the same config ends with the same parameters
    cfg = TrainConfig(**{k: v for k, v in BASE.items() if k != "gpus"})
    straight = tmp_path / "straight"
    run_worker(straight, nproc=2, **{**cfg.to_dict(), "checkpoint_dir": str(straight / "ck"),
                                     "strategy": "ddp", "device": "cpu"})
    a, b = load_file(out["checkpoint"])["model"], load_file(result(straight)["checkpoint"])["model"]
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k


def test_prefect_retry_of_the_launch_resumes_the_same_mlflow_run(prefect_api, store, monkeypatch, tmp_path):
    monkeypatch.setenv("GPUFLOW_FAULT", f"rank=0,epoch=2,step=1,once={tmp_path / 'fired'}")
    out = train_pipeline(**BASE, strategy="single", launch_retries=1, **store)
    assert (tmp_path / "fired").exists()  # the first attempt really died
    client, runs = _runs(store)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert out["resumed_from"].endswith("epoch-0001.pt")
    assert sorted(m.step for m in client.get_metric_history(out["run_id"], "val_loss")) == [1, 2, 3]


def test_three_concurrent_flow_runs_share_one_sqlite_store(prefect_api, store):
    outs, errors = [], []

    def one(seed):
        try:
            outs.append(train_pipeline(**{**BASE, "seed": seed}, strategy="single", **store))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(s,)) for s in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    client, runs = _runs(store)
    assert len(runs) == 3 and {r.info.status for r in runs} == {"FINISHED"}
    for r in runs:
        for key in ("train_loss", "val_loss", "val_accuracy"):
            assert sorted(m.step for m in client.get_metric_history(r.info.run_id, key)) == [1, 2, 3]
    db = store["tracking_uri"].removeprefix("sqlite:///")
    import sqlite3

    assert sqlite3.connect(db).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_node_that_never_arrives_fails_within_the_rendezvous_timeout(tmp_path):
    p = PipelineParams(**BASE, nnodes=2, node_rank=0, rdzv_endpoint=f"127.0.0.1:{_free_port()}",
                       rdzv_timeout_s=10, dist_timeout_s=10, cpu_processes=1)
    plan = assign_devices_for(read_environment(with_torch=False), p, p.batch_size)
    cfg = worker_config(p, plan, folder=RunFolder(tmp_path)).to_json(tmp_path / "config.json")
    start = time.monotonic()
    with pytest.raises(TrainingFailed, match="training failed: exited with code 1; its last line: .*Timed out"):
        launch(cfg, plan, p, tmp_path, logging.getLogger("t"))
    assert time.monotonic() - start < 120
    assert not (tmp_path / "checkpoints").exists()


# --- bad input: what the user sees ------------------------------------------------------

FAKE4 = EnvironmentReport(hostname="gpu-box", cpu_count=16, source="nvml", gpus=[
    GpuInfo(index=i, uuid=f"GPU-fake-{i}", pci_bus_id=f"00000000:{i + 1:02X}:00.0", name="NVIDIA H100",
            compute_capability="9.0", memory_total_mb=80_000, memory_free_mb=80_000) for i in range(4)])


def _ckpt(tmp: Path, kind: str) -> str:
    path = tmp / f"{kind}.pt"
    if kind == "corrupt":
        path.write_bytes(b"\x00garbage, half a checkpoint")
    elif kind == "cnn":
        torch.save({"model": SmallCNN().state_dict(), "epoch": 1}, path)
    elif kind == "pickled":
        torch.save({"model": SimpleNN().state_dict(), "hook": socket.socket}, path)
    return str(path)


BAD_INPUT = [  # (case, parameters, fake GPU host?, what the user sees)
    ("unknown model", dict(model="vgg"), None, "unknown model 'vgg'; choose one of mlp, cnn, resnet18"),
    ("unknown dataset", dict(dataset="imagenet"), None, "unknown dataset 'imagenet'; choose one of"),
    ("unknown strategy", dict(strategy="fsdp"), None, "Input should be 'auto', 'single', 'dp' or 'ddp'"),
    ("offline dataset without files", dict(dataset="mnist", data_root="{tmp}/nothing"), None,
     "dataset 'mnist' not found under '{tmp}/nothing'"),
    ("GPU id that does not exist", dict(gpus="5,"), FAKE4,
     "physical GPU 5 does not exist on gpu-box; present: 0, 1, 2, 3"),
    ("GPU hidden by inherited CUDA_VISIBLE_DEVICES", dict(gpus="3,"),
     FAKE4.model_copy(update={"cuda_visible_devices": "1,2"}),
     "physical GPU 3 is hidden by the inherited CUDA_VISIBLE_DEVICES='1,2'; usable here: 1, 2"),
    ("global batch smaller than devices", dict(gpus="3,2,0,1", strategy="dp", batch_size=2), FAKE4,
     "global batch_size 2 is smaller than the 4 devices of this dp plan"),
    ("fp16 on CPU", dict(precision="fp16"), None, "precision 'fp16' needs CUDA"),
    ("zero epochs", dict(epochs=0), None, "epochs=0: Input should be greater than or equal to 1"),
    ("negative batch size", dict(batch_size=-1), None, "batch_size=-1: Input should be greater than or equal to 1"),
    ("zero learning rate", dict(lr=0.0), None, "lr=0.0: Input should be greater than 0"),
    ("corrupt checkpoint", dict(resume="ckpt:corrupt"), None, "is corrupt or not a torch file"),
    ("checkpoint of another architecture", dict(resume="ckpt:cnn"), None,
     "does not fit model SimpleNN: missing keys ['fc1.bias', 'fc1.weight', 'fc2.bias', 'fc2.weight']"),
    ("resume path that does not exist", dict(resume="{tmp}/gone.pt"), None,
     "checkpoint '{tmp}/gone.pt' does not exist; check the resume path"),
    ("checkpoint with a pickled object", dict(resume="ckpt:pickled"), None,
     "refusing to load '{tmp}/pickled.pt': it contains pickled Python objects"),
    ("rendezvous port in use", dict(nnodes=2, rdzv_endpoint="127.0.0.1:{port}"), None,
     "rendezvous port {port} on 127.0.0.1 is already in use"),
]


@pytest.mark.parametrize("case,params,fake_host,message", BAD_INPUT, ids=[b[0] for b in BAD_INPUT])
def test_bad_input_fails_fast_with_a_clear_message(case, params, fake_host, message, prefect_api,
                                                   store, tmp_path, monkeypatch):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    fill = {"tmp": str(tmp_path), "port": str(listener.getsockname()[1])}
    params = {k: (v.format(**fill) if isinstance(v, str) else v) for k, v in params.items()}
    if str(params.get("resume", "")).startswith("ckpt:"):
        params["resume"] = _ckpt(tmp_path, params["resume"][5:])
    if fake_host is not None:
        monkeypatch.setattr("gpuflow.tasks.devices.probe.read_environment", lambda **_: fake_host)
    args = {**dict(BASE, gpus="cpu", epochs=1), **params, **store}
    try:
        with pytest.raises(Exception) as err:
            train_pipeline(**args)
    finally:
        listener.close()
    text = one_line(err.value) if isinstance(err.value, ValidationError) else str(err.value)
    assert message.format(**fill) in text, text
    _, runs = _runs(store) if Path(store["tracking_uri"][10:]).exists() else (None, [])
    assert all(r.info.status == "FAILED" for r in runs)  # none left RUNNING (none started, here)
    assert not list(Path(store["runs_dir"]).rglob("*.pt")), "no checkpoint may be written"


def test_every_checkpoint_load_in_the_project_uses_weights_only():
    calls = []
    for folder in ("training", "tasks", "flows"):
        for py in (ROOT / folder).glob("*.py"):
            calls += [(py.name, m) for m in re.findall(r"torch\.load\([^)]*\)", py.read_text())]
    assert calls, "expected at least one torch.load call"
    for name, call in calls:
        assert "weights_only=True" in call, (name, call)
