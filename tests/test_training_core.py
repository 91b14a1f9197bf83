"""Training core: resume, checkpoints, safety, data, config validation, real learning."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from tests.helpers import ROOT, child_env, result, run_worker
from gpuflow.training import TrainConfig
from gpuflow.training.__main__ import run
from gpuflow.training.checkpoint import CheckpointError, CheckpointStore, load_file, load_model_state
from gpuflow.training.data import DatasetError, load_data
from gpuflow.training.models import SimpleNN


def _run_inprocess(workdir: Path, **cfg) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    cfg.setdefault("checkpoint_dir", str(workdir / "ckpt"))
    TrainConfig(**cfg).to_json(workdir / "cfg.json")
    return run(str(workdir / "cfg.json"), None)


SMALL = dict(dataset="synthetic", synthetic_size=600, batch_size=50, seed=3, model="cnn")


def test_two_epochs_straight_equal_one_epoch_resume_one_epoch(tmp_path):
    straight = _run_inprocess(tmp_path / "a", epochs=2, **SMALL)
    _run_inprocess(tmp_path / "b", epochs=1, **SMALL)
    resumed = _run_inprocess(tmp_path / "b", epochs=2, **SMALL)  # resume=auto
    assert resumed["resumed_from"].endswith("epoch-0001.pt")
    assert [h["epoch"] for h in resumed["history"]] == [1, 2]
    a, b = load_file(straight["checkpoint"]), load_file(resumed["checkpoint"])
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["epoch"] == b["epoch"] == 2
    assert a["config"]["model"] == "cnn"  # the config travels in every checkpoint


def test_a_resume_from_a_file_trains_with_the_runs_own_lr_and_momentum_and_its_optimizer_only(tmp_path):
    first = _run_inprocess(tmp_path / "a", epochs=1, optimizer="sgd", lr=0.1, momentum=0.9, **SMALL)
    again = _run_inprocess(tmp_path / "b", epochs=2, optimizer="sgd", lr=0.001, momentum=0.5,
                           resume=first["checkpoint"], **SMALL)
    assert again["resumed_from"] == first["checkpoint"]
    saved = load_file(again["checkpoint"])["optimizer"]
    assert [(g["lr"], g["momentum"]) for g in saved["param_groups"]] == [(0.001, 0.5)]
    assert saved["state"]  # the momentum buffers came with the checkpoint
    with pytest.raises(CheckpointError, match="holds sgd state, but this run's optimizer is adam; resume with "
                                              "--optimizer sgd"):
        _run_inprocess(tmp_path / "c", epochs=2, optimizer="adam", resume=first["checkpoint"], **SMALL)


def test_a_run_keeps_its_newest_checkpoints_and_its_best_and_resumes_from_the_newest(tmp_path):
    res = _run_inprocess(tmp_path, epochs=6, keep_checkpoints=2, **SMALL)
    best = max(res["history"], key=lambda h: h["val_accuracy"])["epoch"]
    kept = sorted(int(p.stem.split("-")[1]) for p in (tmp_path / "ckpt").glob("epoch-*.pt"))
    assert kept == sorted({5, 6, best})  # 6 epochs, at most 3 files
    again = _run_inprocess(tmp_path, epochs=7, keep_checkpoints=1, **SMALL)  # resume=auto: the newest
    assert again["resumed_from"].endswith("epoch-0006.pt") and [h["epoch"] for h in again["history"]][-1] == 7
    kept = sorted(int(p.stem.split("-")[1]) for p in (tmp_path / "ckpt").glob("epoch-*.pt"))
    best = max(again["history"], key=lambda h: h["val_accuracy"])["epoch"]
    assert kept == sorted({7, best})


def test_a_first_attempt_is_refused_a_folder_holding_another_runs_checkpoints(tmp_path):
    # A worker started again in a folder holding an earlier run's checkpoints took the folder's newest file and
    # silently ignored the one it was given; with `never`, or with a file given, retention (the newest epochs) then
    # kept the earlier run's higher epochs and deleted this run's, and a restart resumed from the earlier run's.
    store = CheckpointStore(tmp_path / "ckpt")
    given = str(tmp_path / "other" / "epoch-0002.pt")
    assert store.resume_path(given, restarted=False) == given  # an empty folder: the file given
    assert store.resume_path("never", restarted=False) is None
    store.save({"epoch": 3}, 3)
    store.save({"epoch": 4}, 4)
    for resume in (given, "never", str(store.path_for(3))):
        with pytest.raises(CheckpointError, match=r"holds checkpoints already \(epochs 3-4\).*--resume auto"):
            store.resume_path(resume, restarted=False)
    assert store.resume_path(str(store.path_for(4)), restarted=False) == str(store.path_for(4))  # its newest
    assert store.resume_path("auto", restarted=False) == store.path_for(4)
    assert store.resume_path(given, restarted=True) == store.path_for(4)  # a restart continues its own progress
    assert store.resume_path("never", restarted=True) == store.path_for(4)


class OwnModule(torch.nn.Module):
    """A model whose only child is named `module`, as a wrapper's is: every key starts with `module.`."""

    def __init__(self):
        super().__init__()
        self.module = torch.nn.Linear(3, 2)


def test_a_model_whose_only_child_is_named_module_loads_its_checkpoint_stripped_of_that_prefix(tmp_path, monkeypatch):
    # A checkpoint's keys lose a wrapper's `module.`; this model's own went too (the two look alike), and the
    # strict loads of the helper's resume and of the registered model refused the model's own checkpoint.
    from types import SimpleNamespace

    from gpuflow.tasks.tracking.registered_model import CheckpointModel
    from gpuflow.training import helper

    monkeypatch.setenv("GPUFLOW_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.delenv("RANK", raising=False)
    model = OwnModule()
    saved = load_file(helper.save_checkpoint(model, epoch=1))["model"]
    assert set(saved) == {"weight", "bias"}
    fresh = OwnModule()
    assert helper.resume(fresh) == 1
    torch.testing.assert_close(fresh.module.weight, model.module.weight)
    weights = tmp_path / "model" / "artifacts" / "weights.pt"
    weights.parent.mkdir(parents=True)
    torch.save(saved, weights)
    registered = CheckpointModel()
    registered.load_context(SimpleNamespace(model_config={"reference": f"{__name__}:OwnModule", "kwargs": {}},
                                            artifacts={"weights": str(weights)}))
    torch.testing.assert_close(registered.model.module.weight, model.module.weight)


def test_an_epoch_whose_monitored_metric_is_nan_is_never_kept_as_the_best(tmp_path):
    # A user metric can be NaN for an epoch (an AUC on a one-class split); no comparison with NaN is true, so it
    # stayed "best" and the real best was deleted.
    store = CheckpointStore(tmp_path)
    history = [{"epoch": e, "val_auc": v} for e, v in enumerate([float("nan"), 0.7, 0.9, 0.8, 0.75], start=1)]
    for h in history:
        store.save({"epoch": h["epoch"]}, h["epoch"])
        store.retain(1, history[:h["epoch"]], "val_auc", "max")
    assert store.epochs() == [3, 5]


def test_a_sweeps_trial_writes_its_last_epochs_checkpoint_alone_and_logs_every_epoch(tmp_path):
    res = _run_inprocess(tmp_path, epochs=4, checkpoint_each_epoch=False, **SMALL)
    assert [p.name for p in (tmp_path / "ckpt").glob("epoch-*.pt")] == ["epoch-0004.pt"]
    assert res["checkpoint"].endswith("epoch-0004.pt") and load_file(res["checkpoint"])["epoch"] == 4
    assert [h["epoch"] for h in res["history"]] == [1, 2, 3, 4]


def test_checkpoint_holds_everything_needed_to_resume(tmp_path):
    res = _run_inprocess(tmp_path, epochs=1, **SMALL)
    ck = load_file(res["checkpoint"])
    assert set(ck) >= {"model", "optimizer", "scaler", "epoch", "rng", "config"}
    assert ck["optimizer"]["state"], "optimizer state (Adam moments) must be saved"


def test_checkpoint_with_pickled_object_is_refused(tmp_path):
    evil = tmp_path / "evil.pt"
    torch.save({"model": SimpleNN().state_dict(), "payload": subprocess.Popen}, evil)
    with pytest.raises(CheckpointError, match="pickled Python objects"):
        load_file(evil)
    # through the worker too: a clear one-line error, exit 2, no traceback
    proc = run_worker(tmp_path / "w", check=False, dataset="synthetic", synthetic_size=200,
                      epochs=1, resume=str(evil))
    assert proc.returncode == 2
    assert "refusing to load" in proc.stderr and "Traceback" not in proc.stderr


def test_interrupted_checkpoint_write_leaves_previous_one_intact(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    good = store.save({"model": SimpleNN().state_dict(), "epoch": 1}, 1)

    def dying_save(obj, f, *a, **k):
        f.write(b"half a file")
        raise KeyboardInterrupt  # the process is killed mid-write

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        store.save({"model": SimpleNN().state_dict(), "epoch": 2}, 2)
    assert store.latest() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch-0001.pt"]
    load_model_state(SimpleNN(), load_file(good)["model"])


def test_corrupt_checkpoint_and_other_architecture_get_clear_errors(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_file(bad)
    from gpuflow.training.models import SmallCNN

    with pytest.raises(CheckpointError, match=r"missing keys \['fc1.bias'"):
        load_model_state(SimpleNN(), SmallCNN().state_dict())
    with pytest.raises(CheckpointError, match="does not exist"):
        load_file(tmp_path / "nope.pt")


@pytest.mark.parametrize("field,value,message", [
    ("model", "vgg", "unknown model 'vgg'"),
    ("dataset", "imagenet", "unknown dataset 'imagenet'"),
    ("strategy", "fsdp", "strategy"),
    ("epochs", 0, "epochs\n.*greater than or equal to 1"),
    ("batch_size", -4, "batch_size\n.*greater than or equal to 1"),
    ("lr", 0.0, "lr\n.*greater than 0"),
    ("lr", float("nan"), "lr\n.*finite number"),
    ("seed", -1, "seed\n.*greater than or equal to 0"),
])
def test_bad_config_values_are_named_in_the_error(field, value, message):
    with pytest.raises(ValidationError, match=message):
        TrainConfig(**{field: value})


def test_fp16_on_cpu_is_refused_before_training(tmp_path):
    with pytest.raises(ValidationError, match="fp16"):
        TrainConfig(precision="fp16", device="cpu")
    if not torch.cuda.is_available():
        proc = run_worker(tmp_path, check=False, precision="fp16", dataset="synthetic",
                          synthetic_size=100, epochs=1)
        assert proc.returncode == 2 and "use 'bf16' or 'fp32'" in proc.stderr
        assert not (tmp_path / "ckpt").exists()  # nothing written


def test_bf16_on_cpu_trains(tmp_path):
    res = _run_inprocess(tmp_path, epochs=1, precision="bf16", **SMALL)
    assert res["epochs_run"] == 1 and res["final_metrics"]["train_loss"] > 0


def test_config_json_round_trip(tmp_path):
    cfg = TrainConfig(model="cnn", epochs=5, precision="bf16", strategy="ddp")
    assert TrainConfig.from_json(cfg.to_json(tmp_path / "c.json")) == cfg


def _write_idx(path: Path, arr: torch.Tensor) -> None:
    dims = arr.shape
    code = 0x08  # unsigned byte
    header = struct.pack(">HBB", 0, code, len(dims)) + b"".join(struct.pack(">I", d) for d in dims)
    path.write_bytes(header + arr.to(torch.uint8).numpy().tobytes())


def test_mnist_loads_through_torchvision_from_local_idx_files(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for prefix, n in (("train", 40), ("t10k", 10)):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", torch.randint(0, 256, (n, 28, 28), generator=g))
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", torch.arange(n) % 10)
    cfg = TrainConfig(dataset="mnist", data_root=str(tmp_path), val_fraction=0.25)
    bundle = load_data(cfg)
    assert len(bundle.train) + len(bundle.val) == 40 and len(bundle.val) == 10
    assert bundle.input_shape == (1, 28, 28) and bundle.num_classes == 10
    assert bundle.fingerprint["num_samples"] == 40 and len(bundle.fingerprint["sha256"]) == 64
    res = _run_inprocess(tmp_path / "run", dataset="mnist", data_root=str(tmp_path), epochs=1,
                         batch_size=8)
    assert res["epochs_run"] == 1


def test_missing_offline_dataset_names_the_path(tmp_path):
    cfg = TrainConfig(dataset="fashion-mnist", data_root=str(tmp_path / "empty"))
    with pytest.raises(DatasetError, match=str(tmp_path / "empty")):
        load_data(cfg)


def test_imagefolder_dataset(tmp_path):
    from PIL import Image

    for cls in ("cat", "dog"):
        (tmp_path / cls).mkdir()
        for i in range(6):
            Image.new("RGB", (20, 16), (i * 40, 0 if cls == "cat" else 200, 0)).save(tmp_path / cls / f"{i}.png")
    bundle = load_data(TrainConfig(dataset=f"imagefolder:{tmp_path}", model="cnn", val_fraction=0.25))
    assert bundle.num_classes == 2 and len(bundle.train) == 9 and len(bundle.val) == 3
    x, y = bundle.train[0]
    assert tuple(x.shape) == bundle.input_shape == (3, 64, 64)


def test_split_is_deterministic_and_disjoint():
    from gpuflow.training.data import split_indices

    a = split_indices(1797, 0.2, 0)
    assert a == split_indices(1797, 0.2, 0)
    assert not set(a[0]) & set(a[1]) and len(a[0]) + len(a[1]) == 1797
    assert a != split_indices(1797, 0.2, 1)


def test_default_dataset_and_mlp_really_learn(tmp_path):
    """The README's figure: digits + mlp, 3 epochs, on 2 CPU cores."""
    res = _run_inprocess(tmp_path, epochs=3, model="mlp", dataset="digits")
    hist = res["history"]
    assert res["final_metrics"]["val_accuracy"] >= 0.90
    assert hist[-1]["train_loss"] < hist[0]["train_loss"]


def test_training_package_never_imports_prefect():
    # ...nor MLflow: only the flow talks to the tracking store
    code = ("import sys, gpuflow.training.trainer, gpuflow.training.data, gpuflow.training.checkpoint, "
            "gpuflow.training.distributed, gpuflow.training.metrics, gpuflow.training.evaluate, "
            "gpuflow.training.__main__; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('prefect', 'mlflow')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for py in (ROOT / "training").glob("*.py"):
        text = py.read_text()
        assert "import prefect" not in text and "from prefect" not in text, py


def test_worker_help_explains_usage():
    proc = subprocess.run([sys.executable, "-m", "gpuflow.training", "--help"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "--config" in proc.stdout and "torchrun" in proc.stdout


def test_ddp_strategy_without_torchrun_says_how_to_launch(tmp_path):
    TrainConfig(strategy="ddp", dataset="synthetic", epochs=1).to_json(tmp_path / "c.json")
    proc = subprocess.run([sys.executable, "-m", "gpuflow.training", "--config", str(tmp_path / "c.json")],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True)
    assert proc.returncode == 2 and "torchrun --nproc_per_node" in proc.stderr


@pytest.mark.gpu
def test_single_gpu_run_with_bf16_and_fp16(tmp_path):
    for prec in ("bf16", "fp16"):
        res = _run_inprocess(tmp_path / prec, epochs=1, precision=prec, device="cuda", **SMALL)
        assert res["device"].startswith("cuda")


SEEDED_WORKERS = """
import json, sys
import numpy as np
import torch
from gpuflow.training import TrainConfig
from gpuflow.training.data import train_loader

class RandomSamples(torch.utils.data.Dataset):  # draws from numpy's global RNG, as augmentation does
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor(np.random.rand())

out = {}
for key, seed in (("a", 5), ("b", 5), ("c", 6)):
    loader, sampler = train_loader(RandomSamples(), TrainConfig(seed=seed, num_workers=2, batch_size=4), 0, 1,
                                   pin=False)
    sampler.set_epoch(0)
    out[key] = torch.cat(list(loader)).tolist()
    del loader
for key, rank, start in (("rank0", 0, 0), ("rank1", 1, 0), ("rank0_resumed", 0, 3)):  # two ranks; a resume
    loader, sampler = train_loader(RandomSamples(), TrainConfig(seed=5, num_workers=2, batch_size=4), rank, 2,
                                   pin=False, start_epoch=start)
    sampler.set_epoch(start)
    out[key] = torch.cat(list(loader)).tolist()
    del loader
print(json.dumps(out))
"""


def test_dataloader_workers_are_seeded_from_the_seed_rank_and_epochs_trained():
    # In a fresh process, as in the real worker: DataLoader workers forked from pytest's
    # process (which hosts the Prefect test server's threads) exited with code 1 in CI.
    proc = subprocess.run([sys.executable, "-c", SEEDED_WORKERS], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    draws = json.loads(proc.stdout.strip().splitlines()[-1])
    assert draws["a"] == draws["b"] and draws["a"] != draws["c"]
    assert len(set(draws["a"])) == 8  # workers did not repeat one another's draws
    # no two ranks draw the same augmentations; a resumed run does not replay its first epochs' draws
    assert len({*draws["rank0"], *draws["rank1"], *draws["rank0_resumed"]}) == 12


@pytest.mark.parametrize("size,out", [(14, 4), (28, 4), (7, 1), (9, (2, 3)), (5, (4, None))])
def test_deterministic_adaptive_pool_matches_the_stock_kernel(size, out):
    # The matrix form (used on CUDA under deterministic=True) must equal nn.AdaptiveAvgPool2d,
    # values and gradients; the CUDA path itself runs in tests/test_gpu.py.
    from gpuflow.training.models import AdaptiveAvgPool2d, _pool_matrix

    x = torch.randn(2, 3, size, size + 1, dtype=torch.float64, requires_grad=True)
    ref = torch.nn.AdaptiveAvgPool2d(out)(x)
    oh, ow = (out, out) if isinstance(out, int) else out
    mine = _pool_matrix(size, oh, x) @ x @ _pool_matrix(size + 1, ow or size + 1, x).T
    assert torch.allclose(ref, mine)
    g = torch.randn_like(ref)
    (ga,) = torch.autograd.grad(ref, x, g)
    (gb,) = torch.autograd.grad(mine, x, g)
    assert torch.allclose(ga, gb)
    assert torch.equal(AdaptiveAvgPool2d(out)(x), ref)  # off CUDA: the stock kernel


def test_rank0_appends_one_metrics_line_per_epoch_to_the_file_the_flow_names(tmp_path):
    from gpuflow.training.metrics import parse_line

    metrics = tmp_path / "metrics.jsonl"
    run_worker(tmp_path / "w", env=child_env(GPUFLOW_METRICS_FILE=str(metrics)), epochs=2, **SMALL)
    lines = [parse_line(line) for line in metrics.read_text().splitlines()]
    assert [step for step, _, _ in lines] == [1, 2]
    hist = result(tmp_path / "w")["history"]
    assert [m["val_accuracy"] for _, _, m in lines] == [h["val_accuracy"] for h in hist]


def test_an_unwritable_metrics_file_warns_and_training_completes(tmp_path):
    # live metrics are a convenience: result.json still has everything
    proc = run_worker(tmp_path / "w", env=child_env(GPUFLOW_METRICS_FILE=str(tmp_path / "no" / "m.jsonl")),
                      epochs=1, **SMALL)
    assert "live metrics off" in proc.stderr and str(tmp_path / "no" / "m.jsonl") in proc.stderr
    assert result(tmp_path / "w")["epochs_run"] == 1


def test_a_checkpoint_is_written_while_the_next_epoch_trains_and_its_metrics_line_follows_the_file(
        tmp_path, monkeypatch):
    """The loop does not wait for the disk: epoch 2 starts while epoch 1's file is still being
    written; each epoch's metrics line comes only once its file is whole (what the relay uploads)."""
    import threading

    from gpuflow.training import metrics as metrics_mod
    from gpuflow.training.trainer import Trainer

    second_epoch, overlapped, lines = threading.Event(), [], []
    save, run_epoch = CheckpointStore.save, Trainer._run_epoch

    def slow_save(self, payload, epoch):
        if epoch == 1:
            overlapped.append(second_epoch.wait(60))  # False if the loop waited for this write
        return save(self, payload, epoch)

    def epoch_started(self, epoch):
        if epoch == 1:
            second_epoch.set()
        return run_epoch(self, epoch)

    def log_epoch(self, epoch, metrics):
        lines.append((epoch, sorted(p.name for p in (tmp_path / "ckpt").glob("epoch-*.pt"))))

    monkeypatch.setattr(CheckpointStore, "save", slow_save)
    monkeypatch.setattr(Trainer, "_run_epoch", epoch_started)
    monkeypatch.setattr(metrics_mod.MetricsFile, "log_epoch", log_epoch)
    out = _run_inprocess(tmp_path, epochs=3, **SMALL)
    assert overlapped == [True]
    assert [e for e, _ in lines] == [1, 2, 3]
    assert all(f"epoch-{e:04d}.pt" in files for e, files in lines), lines
    assert out["checkpoint"].endswith("epoch-0003.pt") and load_file(out["checkpoint"])["epoch"] == 3


def test_an_epoch_that_fails_while_the_last_checkpoint_is_written_still_logs_that_epoch(tmp_path, monkeypatch):
    """Epoch 2 diverges while epoch 1's file is still being written: the worker waits for it, so
    epoch 1 keeps both its file and its metrics line (the metrics file closes only after)."""
    import time

    from gpuflow.training import metrics as metrics_mod
    from gpuflow.training.errors import TrainingDiverged
    from gpuflow.training.trainer import Trainer

    lines, save, run_epoch = [], CheckpointStore.save, Trainer._run_epoch

    def slow_save(self, payload, epoch):
        time.sleep(1.0)
        return save(self, payload, epoch)

    def diverge_in_the_second(self, epoch):
        if epoch == 1:
            raise TrainingDiverged("train_loss is nan in epoch 2")
        return run_epoch(self, epoch)

    def log_epoch(self, epoch, metrics):
        if self._file is not None:  # what the real one writes: nothing once the file is closed
            lines.append(epoch)

    monkeypatch.setattr(CheckpointStore, "save", slow_save)
    monkeypatch.setattr(Trainer, "_run_epoch", diverge_in_the_second)
    monkeypatch.setattr(metrics_mod.MetricsFile, "log_epoch", log_epoch)
    monkeypatch.setenv("GPUFLOW_METRICS_FILE", str(tmp_path / "metrics.jsonl"))
    with pytest.raises(TrainingDiverged):
        _run_inprocess(tmp_path, epochs=3, **SMALL)
    assert lines == [1]
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.pt")) == ["epoch-0001.pt"]
