"""Prepared datasets (training/datacache.py): read the source once, reuse it while it is unchanged."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpuflow.tasks.data import prepare_dataset
from tests.helpers import ROOT, result, run_worker
from tests.test_training_core import _write_idx
from gpuflow.training import TrainConfig, datacache
from gpuflow.training.data import DatasetError, load_data

DESCRIBE = """
import json, sys
from gpuflow.training import TrainConfig
from gpuflow.tasks.data import prepare_dataset
info = prepare_dataset.fn(TrainConfig(**json.loads(sys.argv[1])))
print(json.dumps({"info": info.model_dump(), "torch": "torch" in sys.modules,
                  "sklearn": "sklearn" in sys.modules}))
"""


def describe_in_fresh_process(**cfg) -> dict:
    out = subprocess.run([sys.executable, "-c", DESCRIBE, json.dumps(cfg)], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_the_digits_are_exactly_what_scikit_learns_load_digits_gives():
    from sklearn.datasets import load_digits

    from gpuflow.training.data import _digits

    x, y, classes = _digits(TrainConfig())
    d = load_digits()
    assert classes == 10 and x.shape == (1797, 1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert torch.equal(x, torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0)
    assert torch.equal(y, torch.tensor(d.target, dtype=torch.int64))


def _mnist(root: Path, seed: int) -> None:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for prefix, n in (("train", 40), ("t10k", 10)):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", torch.randint(0, 256, (n, 28, 28), generator=g))
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", torch.arange(n) % 10)


MNIST = {"dataset": "mnist", "val_fraction": 0.25}  # 40 samples of tests' own idx files (_mnist)


def test_the_digits_are_described_without_torch_or_scikit_learn_and_match_what_the_workers_load(tmp_path):
    """Read from their 0.5 MB file by each worker: the flow's data step writes nothing, even the first time."""
    info = describe_in_fresh_process(data_root=str(tmp_path))
    assert info["torch"] is False and info["sklearn"] is False
    assert info["info"]["cache"] is None and info["info"]["reused"] is False and not list(tmp_path.iterdir())
    bundle = load_data(TrainConfig(data_root=str(tmp_path)))  # the counts come from the description alone
    assert (info["info"]["train_samples"], info["info"]["val_samples"]) == (len(bundle.train), len(bundle.val))
    assert info["info"]["sha256"] == bundle.fingerprint["sha256"]
    assert info["info"]["num_classes"] == 10 and info["info"]["input_shape"] == [1, 28, 28]  # the mlp's


def test_second_run_reuses_the_prepared_file_without_importing_torch(tmp_path):
    _mnist(tmp_path, seed=0)
    first = describe_in_fresh_process(data_root=str(tmp_path), **MNIST)
    second = describe_in_fresh_process(data_root=str(tmp_path), **MNIST)
    assert first["info"]["reused"] is False and first["torch"] is True
    assert second["info"]["reused"] is True and second["torch"] is False
    assert second["info"] == {**first["info"], "reused": True}
    assert Path(second["info"]["cache"]).parent == tmp_path / ".gpuflow-cache"
    # the counts come from the description alone and must match the real split
    bundle = load_data(TrainConfig(data_root=str(tmp_path), **MNIST))
    assert (second["info"]["train_samples"], second["info"]["val_samples"]) == (len(bundle.train), len(bundle.val))
    assert second["info"]["sha256"] == bundle.fingerprint["sha256"]


def test_workers_read_the_prepared_file_and_get_the_same_tensors(tmp_path):
    _mnist(tmp_path, seed=0)
    info = prepare_dataset.fn(TrainConfig(data_root=str(tmp_path), model="cnn", **MNIST))
    a = load_data(TrainConfig(data_root=str(tmp_path), model="cnn", data_cache=info.cache, **MNIST))
    b = load_data(TrainConfig(data_root=str(tmp_path), model="cnn", **MNIST))
    for part in ("train", "val"):
        assert torch.equal(getattr(a, part).x, getattr(b, part).x)
        assert torch.equal(getattr(a, part).y, getattr(b, part).y)
    assert a.fingerprint == b.fingerprint and list(a.input_shape) == info.input_shape
    # and the real worker trains from it
    run_worker(tmp_path / "w", epochs=1, data_root=str(tmp_path), data_cache=info.cache, batch_size=16, **MNIST)
    assert result(tmp_path / "w")["epochs_run"] == 1


def test_a_changed_source_gets_a_fresh_prepared_file(tmp_path):
    _mnist(tmp_path, seed=0)
    cfg = TrainConfig(dataset="mnist", data_root=str(tmp_path), val_fraction=0.25)
    a = prepare_dataset.fn(cfg)
    assert not a.reused and prepare_dataset.fn(cfg).reused
    stored = torch.load(a.cache, weights_only=True)
    assert stored["x"].dtype == torch.uint8 and tuple(stored["x"].shape) == (40, 1, 28, 28)  # compact
    _mnist(tmp_path, seed=1)  # the source is replaced: different images
    b = prepare_dataset.fn(cfg)
    assert not b.reused and b.cache != a.cache and b.sha256 != a.sha256
    assert b.sha256 == load_data(cfg).fingerprint["sha256"]


def test_a_truncated_prepared_file_is_rebuilt_and_an_unreadable_one_names_the_fix(tmp_path):
    _mnist(tmp_path, seed=0)
    info = prepare_dataset.fn(TrainConfig(data_root=str(tmp_path), **MNIST))
    Path(info.cache).write_bytes(Path(info.cache).read_bytes()[:100])
    again = prepare_dataset.fn(TrainConfig(data_root=str(tmp_path), **MNIST))
    assert not again.reused and again.cache == info.cache and again.sha256 == info.sha256
    Path(info.cache).write_bytes(b"not a torch file")
    with pytest.raises(DatasetError, match="Delete it"):
        load_data(TrainConfig(data_cache=info.cache, **MNIST))


def test_a_prepared_file_corrupted_in_place_is_rebuilt_from_the_source(tmp_path):
    _mnist(tmp_path / "a", seed=0)
    _mnist(tmp_path / "fresh", seed=0)
    cfg = TrainConfig(data_root=str(tmp_path / "a"), **MNIST)
    info = prepare_dataset.fn(cfg)
    cache = Path(info.cache)
    good = cache.read_bytes()
    meta = json.loads(cache.with_suffix(".json").read_text())
    assert meta["file_sha256"] == hashlib.sha256(good).hexdigest()  # the file's bytes...
    assert meta["sha256"] == info.sha256 == load_data(cfg).fingerprint["sha256"]  # ...and the data's
    # flip 64 bytes in the middle (the pixels), keeping the size: torch still reads it, wrongly
    bad = bytearray(good)
    mid = len(bad) // 2
    bad[mid:mid + 64] = bytes(b ^ 0xFF for b in bad[mid:mid + 64])
    cache.write_bytes(bytes(bad))
    assert cache.stat().st_size == len(good)
    x_bad = datacache.load(str(cache))[0]  # silent bit rot: no error, other pixels
    again = prepare_dataset.fn(cfg)
    assert not again.reused and again.cache == info.cache and again.sha256 == info.sha256
    fresh = prepare_dataset.fn(TrainConfig(data_root=str(tmp_path / "fresh"), **MNIST))
    assert cache.read_bytes() == Path(fresh.cache).read_bytes() == good  # a fresh build, byte for byte
    assert not torch.equal(x_bad, datacache.load(str(cache))[0])
    assert prepare_dataset.fn(cfg).reused


def test_the_digits_come_from_scikit_learns_own_loader_where_its_file_is_elsewhere(monkeypatch):
    from gpuflow.training.data import _digits

    expected = _digits(TrainConfig())
    monkeypatch.setattr(datacache, "digits_csv", lambda: None)  # a release that moved digits.csv.gz
    x, y, classes = _digits(TrainConfig())
    assert classes == 10 and torch.equal(x, expected[0]) and torch.equal(y, expected[1])
