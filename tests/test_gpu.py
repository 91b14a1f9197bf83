"""CUDA tests on a real GPU. Skipped where torch sees none (conftest.py), as on CI; run on
the lent H100 with `python -m pytest -m gpu` (results in bench/NOTES.md)."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import mlflow
import pytest
import torch

from gpuflow.flows.train import train_pipeline
from gpuflow.flows.params import PipelineParams
from gpuflow.tasks.devices.assign import AssignmentError, assign_devices_for
from gpuflow.tasks.devices.probe import read_environment
from tests.helpers import child_env, result, run_worker, user_project
from gpuflow.training.checkpoint import load_file
from gpuflow.training.models import SmallCNN

pytestmark = pytest.mark.gpu

SMALL = dict(dataset="digits", model="cnn", epochs=2, batch_size=64, seed=1)


def test_probe_reads_real_gpus_from_nvml_agrees_with_torch_and_leaves_cuda_untouched():
    report = read_environment()
    assert report.source == "nvml" and report.gpus
    assert report.torch_device_count == len(report.gpus), report.warnings
    for g in report.gpus:
        assert g.uuid.startswith("GPU-") and re.fullmatch(r"[0-9A-F:.]+", g.pci_bus_id.upper())
        assert re.fullmatch(r"\d+\.\d+", g.compute_capability) and g.memory_total_mb > 1000
        assert 0 <= g.memory_free_mb <= g.memory_total_mb
    assert report.driver_version and report.cuda_version and report.nccl_version
    assert report.backends.get("nccl") is True and report.bf16_supported
    assert not torch.cuda.is_initialized()  # the torch cross-check ran in a child


def test_ddp_over_nccl_with_bf16_trains_and_its_checkpoint_loads_on_cpu(tmp_path):
    run_worker(tmp_path, nproc=1, strategy="ddp", device="cuda", precision="bf16", **SMALL)
    res = result(tmp_path)
    assert res["device"] == "cuda:0" and res["world_size"] == 1 and res["peak_memory_mb"] > 0
    assert res["data_on_device"] is True  # small in-memory data is gathered on the GPU
    assert res["final_metrics"]["val_accuracy"] > 0.5
    state = load_file(res["checkpoint"])["model"]
    assert not any(k.startswith("module.") for k in state)
    SmallCNN(in_channels=1, num_classes=10).load_state_dict(state)  # a plain model on the CPU


def test_dataparallel_on_the_primary_card_with_fp16_and_grad_scaler(tmp_path):
    run_worker(tmp_path, strategy="dp", device="cuda", device_ids=[0], precision="fp16", num_workers=1, **SMALL)
    res = result(tmp_path)
    assert res["strategy"] == "dp" and res["device"] == "cuda:0"
    assert res["data_on_device"] is False  # --num-workers 1 keeps the host loader path
    assert res["final_metrics"]["val_accuracy"] > 0.5
    assert not any(k.startswith("module.") for k in load_file(res["checkpoint"])["model"])


def test_a_batch_of_data_held_on_the_gpu_is_gathered_without_a_host_sync():
    # Before: torch.as_tensor(indices, device="cuda") was a blocking copy, a stream sync every step
    # (ours/bare 0.86-0.90 on the H100, bench/RESULTS_GPU.md).
    from gpuflow.training.data import TensorData

    data = TensorData(torch.rand(64, 3, device="cuda"), torch.arange(64, device="cuda"))
    torch.cuda.set_sync_debug_mode("error")
    try:
        x, y = data[list(range(0, 64, 2))]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert x.shape == (32, 3) and torch.equal(y.cpu(), torch.arange(0, 64, 2))


def test_dataparallel_device_id_the_child_cannot_see_is_a_clear_error(tmp_path):
    proc = run_worker(tmp_path, strategy="dp", device="cuda", device_ids=[0, 7], check=False,
                      env=child_env(CUDA_VISIBLE_DEVICES="0"), **SMALL)
    assert proc.returncode != 0
    assert "DataParallel device_ids [0, 7] include [7]" in proc.stderr + proc.stdout


@pytest.mark.parametrize("model", ["cnn", "resnet18"])
def test_deterministic_cuda_runs_repeat_bit_for_bit(tmp_path, model):
    # both models pool adaptively, whose stock CUDA backward refuses deterministic mode
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        run_worker(d, device="cuda", deterministic=True, **{**SMALL, "model": model, "epochs": 1})
    sa, sb = load_file(result(a)["checkpoint"])["model"], load_file(result(b)["checkpoint"])["model"]
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_a_card_busy_with_another_process_is_skipped_by_auto():
    report = read_environment()
    card = report.gpus[0].index
    holder = subprocess.Popen(
        [sys.executable, "-c", "import torch, time; x = torch.ones(1, device='cuda'); print('up', flush=True); "
                               "time.sleep(120)"],
        env=child_env(CUDA_VISIBLE_DEVICES=str(card), CUDA_DEVICE_ORDER="PCI_BUS_ID"),
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "up"
        deadline = time.time() + 30
        while time.time() < deadline:
            busy = {g.index: g.processes for g in read_environment(with_torch=False).gpus}
            if busy[card] >= 1:
                break
            time.sleep(1)
        assert busy[card] >= 1, f"NVML shows no process on GPU {card}: {busy}"
        others = [i for i, n in busy.items() if i != card and n == 0]
        report = read_environment(with_torch=False)
        if others:
            plan = assign_devices_for(report, PipelineParams(gpus="1"), 8)
            assert card not in plan.physical_ids
        else:
            with pytest.raises(AssignmentError, match="busy"):
                assign_devices_for(report, PipelineParams(gpus="1"), 8)
    finally:
        holder.kill()
        holder.wait()


def test_pipeline_on_a_physical_gpu_logs_gpu_facts_and_a_portable_checkpoint(prefect_api, store):
    gpu = read_environment(with_torch=False).gpus[-1].index
    out = train_pipeline(**SMALL, gpus=f"{gpu},", strategy="ddp", precision="bf16", **store)
    assert out["status"] == "FINISHED" and out["device"] == "cuda:0"
    mlflow.set_tracking_uri(store["tracking_uri"])
    run = mlflow.MlflowClient().get_run(out["run_id"])
    tags = run.data.tags
    assert tags["physical_gpus"] == str(gpu) and tags["primary_gpu"] == str(gpu) and tags["backend"] == "nccl"
    assert run.data.metrics["val_accuracy"] == pytest.approx(out["final_metrics"]["val_accuracy"])
    raw = torch.load(out["checkpoint"], weights_only=True)  # no map_location: saved on the CPU
    state = raw["model"]
    assert all(t.device.type == "cpu" for t in state.values())
    assert all(t.device.type == "cpu" for s in raw["optimizer"]["state"].values() for t in s.values()
               if isinstance(t, torch.Tensor))
    assert not any(k.startswith("module.") for k in state)


def test_a_cuda_run_resumes_with_every_rng_state_restored(tmp_path):
    # Before: set_rng_state failed with "can't convert cuda:0 device type tensor to numpy".
    ck = tmp_path / "ck"
    run_worker(tmp_path / "a", env=child_env(CUDA_VISIBLE_DEVICES="0"), checkpoint_dir=str(ck),
               device="cuda", **SMALL)
    proc = run_worker(tmp_path / "b", env=child_env(CUDA_VISIBLE_DEVICES="0"), checkpoint_dir=str(ck),
                      device="cuda", **{**SMALL, "epochs": 3})
    res = result(tmp_path / "b")
    assert res["epochs_run"] == 3 and res["resumed_from"].endswith("epoch-0002.pt"), proc.stderr[-2000:]
    straight = run_worker(tmp_path / "c", env=child_env(CUDA_VISIBLE_DEVICES="0"), device="cuda",
                          **{**SMALL, "epochs": 3, "deterministic": True})
    assert straight.returncode == 0


# --- a user's own model on the GPU (issue 16): dp + fp16, and ddp + bf16 ----------------------


def _loads_strict_on_cpu(proj, checkpoint: str, cls: str) -> None:
    """The user's own class, in a fresh process run from the user's folder, takes the weights."""
    code = (f"import torch\nfrom training.{cls} import *\nck = torch.load({checkpoint!r}, weights_only=True)\n"
            f"spec = ck['model_spec']\nassert not any(k.startswith('module.') for k in ck['model'])\n"
            f"globals()[spec['reference'].split(':')[1]](**spec['kwargs']).load_state_dict(ck['model'], strict=True)\n"
            "print('loaded')")
    out = subprocess.run([sys.executable, "-c", code], cwd=proj, capture_output=True, text=True, timeout=120,
                         env=child_env(CUDA_VISIBLE_DEVICES=""))
    assert "loaded" in out.stdout, out.stderr[-2000:]


def test_a_user_model_with_its_own_objective_trains_under_dataparallel_with_fp16(tmp_path):
    proj = user_project(tmp_path / "proj")
    run_worker(tmp_path / "dp", strategy="dp", device="cuda", device_ids=[0], precision="fp16", epochs=5, lr=0.01,
               seed=1, model="training.regression:Regressor", dataset="training.regression:datasets",
               objective="training.regression:MSE", code_root=str(proj), data_root=str(proj / "data"))
    res = result(tmp_path / "dp")
    assert (res["strategy"], res["device"], res["objective"]) == ("dp", "cuda:0", "training.regression:MSE")
    assert res["final_metrics"]["val_r2"] > 0.8, res["final_metrics"]  # dict samples, its own loss and metrics
    _loads_strict_on_cpu(proj, res["checkpoint"], "regression")


def test_a_user_model_on_its_own_dataset_trains_under_ddp_over_nccl_with_bf16(tmp_path):
    proj = user_project(tmp_path / "proj")
    subprocess.run([sys.executable, "-c", "from training.data import prepare_data; prepare_data('data')"],
                   cwd=proj, check=True, timeout=120)  # the flow's data step does this
    run_worker(tmp_path / "ddp", nproc=1, strategy="ddp", device="cuda", precision="bf16", epochs=3, seed=1,
               model="training.nets:Net", model_args={"width": 32}, dataset="training.data:datasets",
               code_root=str(proj), data_root=str(proj / "data"))
    res = result(tmp_path / "ddp")
    assert res["device"] == "cuda:0" and res["final_metrics"]["val_accuracy"] > 0.6, res["final_metrics"]
    _loads_strict_on_cpu(proj, res["checkpoint"], "nets")
