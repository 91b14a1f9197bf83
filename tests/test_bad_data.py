"""Data that cannot train, and a full disk, are refused in one line before any worker starts."""

from __future__ import annotations

import errno
import subprocess
from pathlib import Path

import mlflow
import pytest
import torch
from PIL import Image

from gpuflow.flows.params import PipelineParams
from gpuflow.tasks.data import DatasetInfo, prepare_dataset
from gpuflow.tasks.preflight import preflight
from gpuflow.training import TrainConfig, datacache
from gpuflow.training.checkpoint import CheckpointStore
from gpuflow.training.data import DatasetError
from gpuflow.training.errors import DiskFull
from gpuflow.training.files import atomic_write
from tests.helpers import BIN, child_env, run_worker
from tests.test_training_core import _write_idx


def image_folder(root: Path, classes=("cat", "dog"), per_class: int = 3) -> Path:
    for name in classes:
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = torch.randint(0, 256, (10, 12, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
            Image.fromarray(pixels.numpy()).save(root / name / f"{i}.png")  # noise: no tiny all-in-one chunk
    return root


def folder_config(root: Path, **kw) -> TrainConfig:
    return TrainConfig(dataset=f"imagefolder:{root}", model="cnn", **kw)


def mnist_source(root: Path, labels: torch.Tensor) -> None:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, y in (("train", labels), ("t10k", labels[:4])):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", torch.randint(0, 256, (len(y), 28, 28)))
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", y)


def leftovers(folder: Path) -> list[str]:
    """Temp files a write left behind (atomic_write names them .<name>.<random>.tmp)."""
    return sorted(str(p) for p in folder.rglob("*.tmp"))


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs: writes past that fail with ENOSPC, as on a full disk."""
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def fill(folder: Path) -> None:
    """Take every free byte of the disk `folder` is on."""
    with open(folder / "filler", "wb", buffering=0) as f:
        with pytest.raises(OSError) as full:
            while True:
                f.write(b"\0" * 4096)
    assert full.value.errno == errno.ENOSPC


# --- data that cannot train ---------------------------------------------------------


def test_an_imagefolder_with_one_class_is_refused_naming_the_class(tmp_path):
    root = image_folder(tmp_path / "pets", classes=("cat",))
    with pytest.raises(DatasetError, match=r"only one class \('cat', all 3 samples\).*at least 2.*add a folder"):
        prepare_dataset.fn(folder_config(root))


def test_unreadable_images_are_named_with_the_count_of_the_others(tmp_path):
    root = image_folder(tmp_path / "pets")
    good = (root / "cat" / "1.png").read_bytes()
    (root / "cat" / "1.png").write_bytes(good[: len(good) // 2])  # truncated
    (root / "dog" / "2.png").write_text("not an image")
    with pytest.raises(DatasetError) as refused:
        prepare_dataset.fn(folder_config(root))
    message = str(refused.value)
    assert repr(str(root / "cat" / "1.png")) in message and "truncated" in message
    assert "and 1 more unreadable images" in message and "\n" not in message
    (root / "cat" / "1.png").write_bytes(good)
    (root / "dog" / "2.png").unlink()
    assert prepare_dataset.fn(folder_config(root)).num_samples == 5  # fixed: accepted


def test_an_empty_class_folder_and_a_folder_without_classes_are_named(tmp_path):
    root = image_folder(tmp_path / "pets")
    (root / "eel").mkdir()
    with pytest.raises(DatasetError, match=r"class folder\(s\) 'eel' hold no images"):
        prepare_dataset.fn(folder_config(root))
    (tmp_path / "bare").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "bare" / "loose.png")
    with pytest.raises(DatasetError, match="has no class folders; expected <path>/<class>/<image>"):
        prepare_dataset.fn(folder_config(tmp_path / "bare"))


def test_a_single_label_source_is_refused_again_when_its_prepared_file_is_reused(tmp_path):
    mnist_source(tmp_path, torch.full((20,), 3))
    cfg = TrainConfig(dataset="mnist", data_root=str(tmp_path))
    with pytest.raises(DatasetError, match=r"'mnist' has only one class \('3', all 20 samples\)"):
        prepare_dataset.fn(cfg)
    assert datacache.lookup("mnist", str(tmp_path)) is not None  # prepared and described...
    with pytest.raises(DatasetError, match=r"only one class \('3'"):  # ...and still refused from there
        prepare_dataset.fn(cfg)


def test_a_split_that_leaves_no_training_sample_is_refused_with_the_counts():
    cfg = TrainConfig(dataset="synthetic", synthetic_size=3, val_fraction=0.9)
    with pytest.raises(DatasetError, match="has 3 samples; val_fraction 0.9 leaves 0 for training and 3 for "
                                           "validation.*lower val_fraction"):
        prepare_dataset.fn(cfg)
    assert prepare_dataset.fn(cfg.model_copy(update={"val_fraction": 0.5})).train_samples == 1


def test_preflight_refuses_fewer_training_samples_than_processes():
    cfg, opts = TrainConfig(dataset="synthetic", val_fraction=0.2), PipelineParams()
    data = DatasetInfo(name="synthetic", num_samples=5, train_samples=4, val_samples=1, num_classes=10,
                       input_shape=[1, 28, 28], sha256="0" * 64)
    with pytest.raises(DatasetError, match=r"leaves 4 for training.*at least 8 \(one per process\).*fewer processes"):
        preflight.fn(cfg, opts, data, world_size=8)
    preflight.fn(cfg, opts, data.model_copy(update={"num_samples": 20}), world_size=4)  # one each: accepted


def test_preflight_refuses_a_built_in_dataset_leaving_a_process_no_validation_sample():
    cfg, opts = TrainConfig(dataset="synthetic", synthetic_size=3), PipelineParams()
    data = prepare_dataset.fn(cfg)  # alone it is fine: 2 to train on, 1 to validate on
    with pytest.raises(DatasetError, match=r"'synthetic' has 3 samples; val_fraction 0.2 leaves 2 for training and 1 "
                                           r"for validation, but training and validation each need at least 2 "
                                           r"\(one per process\): raise synthetic_size, raise val_fraction, or run fewer"):
        preflight.fn(cfg, opts, data, world_size=2)


USER_DATA = """
import torch
from torch.utils.data import TensorDataset

def datasets(root):
    x = torch.randn(8, 1, 28, 28)
    return {"train": TensorDataset(x, torch.arange(8) % 10), "val": TensorDataset(x[:1], torch.zeros(1).long()),
            "num_classes": 10}
"""


def test_preflight_refuses_a_user_dataset_leaving_a_process_no_validation_sample(tmp_path):
    from gpuflow.training.preflight import check_user_code

    (tmp_path / "onevalproj.py").write_text(USER_DATA)
    cfg = TrainConfig(dataset="onevalproj:datasets", code_root=str(tmp_path))
    with pytest.raises(DatasetError, match=r"'onevalproj:datasets' has 8 training and 1 validation samples, but "
                                           r"training and validation each need at least 2 \(one per process\)"):
        check_user_code(cfg, world_size=2)
    assert check_user_code(cfg, world_size=1)["num_classes"] == 10


def test_gpuflow_run_on_too_small_a_built_in_dataset_is_one_line_exit_2_before_any_worker(tmp_path, prefect_api):
    from prefect.settings import PREFECT_API_URL

    env = child_env(MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}", PREFECT_API_URL=PREFECT_API_URL.value())
    proc = subprocess.run([str(BIN / "gpuflow"), "run", "--dataset", "synthetic", "--synthetic-size", "3", "--epochs",
                           "1", "--gpus", "cpu", "--cpu-processes", "2", "--runs-dir", str(tmp_path / "runs")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("gpuflow run:")]
    assert len(lines) == 1 and "at least 2 (one per process)" in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "KeyError" not in proc.stderr and "[rank" not in proc.stderr
    assert not (tmp_path / "runs").exists()


# --- a full disk --------------------------------------------------------------------


def test_atomic_write_on_a_full_disk_names_the_path_and_leaves_no_temp_file(small_disk):
    target = small_disk / "sub" / "big.bin"
    with pytest.raises(DiskFull, match=rf"disk full: cannot write '{target}' \(No space left on device\); "
                                       "free space"):
        atomic_write(target, lambda tmp: tmp.write_bytes(b"\0" * 200_000))
    assert not target.exists() and leftovers(small_disk) == []


def test_a_checkpoint_save_on_a_full_disk_raises_disk_full_and_keeps_nothing(small_disk):
    store = CheckpointStore(small_disk / "ckpt")
    with pytest.raises(DiskFull, match="epoch-0001.pt"):
        store.save({"model": {"w": torch.zeros(100_000)}}, 1)
    assert store.latest() is None and leftovers(small_disk) == []
    assert store.save({"model": {"w": torch.zeros(10)}}, 1) == store.path_for(1)  # it fits: saved


def test_the_prepared_dataset_on_a_full_disk_is_refused_naming_its_path(small_disk):
    mnist_source(small_disk, torch.arange(20) % 10)
    fill(small_disk)
    with pytest.raises(DiskFull, match=rf"cannot write '{small_disk}/{datacache.CACHE_DIR}/mnist-\w+\.pt'"):
        prepare_dataset.fn(TrainConfig(dataset="mnist", data_root=str(small_disk)))
    assert leftovers(small_disk) == [] and not list(small_disk.rglob("*.pt"))


def test_a_worker_whose_checkpoint_does_not_fit_exits_2_with_the_disk_full_line(tmp_path, small_disk):
    proc = run_worker(tmp_path / "w", check=False, epochs=1, model="mlp", checkpoint_dir=str(small_disk / "ckpt"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"[rank 0] error: disk full: cannot write '{small_disk / 'ckpt' / 'epoch-0001.pt'}'" in proc.stderr
    assert "Traceback" not in proc.stderr and leftovers(small_disk) == []


# --- through the CLI ----------------------------------------------------------------


def test_gpuflow_run_refuses_a_one_class_imagefolder_with_exit_2_and_creates_nothing(tmp_path):
    root = image_folder(tmp_path / "pets", classes=("cat",))
    db = tmp_path / "mlflow.db"
    env = child_env(PREFECT_HOME=str(tmp_path / "ph"), MLFLOW_TRACKING_URI=f"sqlite:///{db}")
    env.pop("PREFECT_API_URL", None)  # the run's own temporary API, as a user's first run has
    proc = subprocess.run([str(BIN / "gpuflow"), "run", "--dataset", f"imagefolder:{root}", "--epochs", "1",
                           "--gpus", "cpu"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "gpuflow run: dataset" in proc.stderr and "only one class ('cat'" in proc.stderr
    assert not list(tmp_path.rglob("checkpoints")) and not list(tmp_path.rglob("epoch-*.pt"))
    if db.exists():  # the data step comes before the MLflow run: none may exist
        client = mlflow.MlflowClient(f"sqlite:///{db}")
        assert client.search_runs([e.experiment_id for e in client.search_experiments()]) == []
