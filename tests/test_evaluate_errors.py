"""`gpuflow infer` and `gpuflow evaluate` on bad input: a checkpoint that is truncated or pickled,
inputs of the wrong shape or not saved as {'inputs': ...}, a model name the store lacks, a
folder with no store: one line on stderr naming the cause, exit 2, and nothing created."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import torch

from gpuflow.tasks.tracking import store
from gpuflow.tasks.tracking.registry import resolve_version
from gpuflow.training.errors import UserError
from tests.helpers import ROOT, child_env, run_worker

GPUFLOW = ROOT / ".venv" / "bin" / "gpuflow"


def _gpuflow(args: list[str], cwd: Path, api: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_API"))}
    if api:
        env["PREFECT_API_URL"] = api
    return subprocess.run([str(GPUFLOW), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


class Pickled:
    def __reduce__(self):
        return (print, ("unpickled",))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A real one-epoch checkpoint (input shape 1x28x28) and bad variants of it and of its inputs."""
    d = tmp_path_factory.mktemp("ck")
    run_worker(d / "w", epochs=1, dataset="synthetic", synthetic_size=64, batch_size=16, model="mlp")
    good = next((d / "w" / "ckpt").glob("epoch-*.pt"))
    data = good.read_bytes()
    (d / "truncated.pt").write_bytes(data[: len(data) // 2])
    torch.save({"model": Pickled()}, d / "pickled.pt")
    torch.save({"inputs": torch.randn(3, 5, 7)}, d / "wrong-shape.pt")
    torch.save(torch.randn(3, 1, 28, 28), d / "bare.pt")
    torch.save({"x": torch.randn(3, 1, 28, 28)}, d / "other-key.pt")
    torch.save({"inputs": torch.randn(3, 1, 28, 28)}, d / "inputs.pt")
    return {"good": good, **{p.stem: p for p in d.glob("*.pt")}}


def _one_line(out: subprocess.CompletedProcess, command: str) -> str:
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith(f"gpuflow {command}:")]
    assert len(lines) == 1, out.stderr[-3000:]
    assert out.stdout == ""
    return lines[0]


CASES = [
    ("truncated", "inputs", "is corrupt or truncated"),
    ("pickled", "inputs", "contains pickled Python objects"),
    ("good", "wrong-shape", "has samples of shape (5, 7), but the model takes (1, 28, 28)"),
    ("good", "bare", "holds a bare tensor of shape (3, 1, 28, 28), not {'inputs': tensor}"),
    ("good", "other-key", "holds a dict with keys ['x'], not {'inputs': tensor}"),
    ("good", "truncated", "cannot be read as tensors"),
]


@pytest.mark.parametrize("checkpoint,inputs,message", CASES, ids=[f"{c}-{i}" for c, i, _ in CASES])
def test_infer_on_a_bad_checkpoint_or_inputs_file_is_one_line_exit_2(files, tmp_path, checkpoint, inputs, message):
    out = _gpuflow(["infer", "--checkpoint", str(files[checkpoint]), "--inputs", str(files[inputs]),
                    "--gpus", "cpu"], tmp_path)
    assert message in _one_line(out, "infer")
    assert list(tmp_path.iterdir()) == []


def test_infer_in_an_empty_folder_says_there_is_no_store_and_creates_none(files, tmp_path):
    out = _gpuflow(["infer", "--inputs", str(files["inputs"]), "--gpus", "cpu"], tmp_path)
    assert f"no MLflow store at {str(tmp_path / 'mlflow.db')!r}" in _one_line(out, "infer")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def api_url(prefect_api):
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def test_evaluate_of_a_truncated_checkpoint_is_one_line_exit_2(files, tmp_path, api_url):
    out = _gpuflow(["evaluate", "--checkpoint", str(files["truncated"]), "--gpus", "cpu"], tmp_path, api_url)
    assert "is corrupt or truncated" in _one_line(out, "evaluate")
    assert list(tmp_path.iterdir()) == []


def test_evaluate_in_an_empty_folder_says_there_is_no_store_and_creates_none(tmp_path, api_url):
    out = _gpuflow(["evaluate", "--gpus", "cpu"], tmp_path, api_url)
    assert "no MLflow store at" in _one_line(out, "evaluate")
    assert list(tmp_path.iterdir()) == []


def test_a_model_name_the_store_lacks_is_named_with_the_ones_it_holds(tmp_path):
    client = store.prepare_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    client.create_registered_model("digits-mlp")
    for version in ("champion", "1"):
        with pytest.raises(UserError) as e:
            resolve_version(client, "gpuflow-model", version)
        assert "registered model 'gpuflow-model' does not exist" in str(e.value)
        assert "the models there: digits-mlp" in str(e.value) and "champion' alias" not in str(e.value)


EXIT_MARKED = ("import atexit, runpy, sys; atexit.register(print, 'interpreter teardown', flush=True); "
               "sys.argv = ['evaluate', *sys.argv[1:]]; "
               "runpy.run_module('gpuflow.training.evaluate', run_name='__main__', alter_sys=True)")


@pytest.mark.parametrize("checkpoint,code", [("good", 0), ("truncated", 2)])
def test_the_evaluation_child_writes_its_report_then_leaves_without_the_interpreters_teardown(
        files, tmp_path, checkpoint, code):
    """The sweep's and retrain's champion evaluation waits on this child: once its report is written it leaves at
    once (the teardown of torch's modules would only delay the parent), the report whole, the exit code kept."""
    out = subprocess.run([sys.executable, "-c", EXIT_MARKED, "--checkpoint", str(files[checkpoint]),
                          "--result", str(tmp_path / "report.json"), "--device", "cpu"],
                         cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=240)
    assert out.returncode == code, out.stderr[-3000:]
    assert "interpreter teardown" not in out.stdout, out.stdout[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    if code == 0:
        assert report[0]["samples"] > 0 and report[0]["model"] == "mlp", report
    else:
        assert "is corrupt or truncated" in report["error"], report


def _evaluated(checkpoints: list[Path], tmp_path: Path, *args: str) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "gpuflow.training.evaluate", "--checkpoint", *map(str, checkpoints),
                          "--result", str(tmp_path / "report.json"), "--device", "cpu", *args],
                         cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((tmp_path / "report.json").read_text())


def test_versions_compared_are_evaluated_on_the_same_samples_and_an_override_is_never_the_old_prepared_copy(
        files, tmp_path):
    """A champion trained on a prepared copy of its data (data_cache) was scored on that copy while the challenger
    was scored on its own data: the retrain and the sweep promoted on two different held-out sets."""
    cache = tmp_path / "old-data.pt"
    torch.save({"x": torch.randn(50, 1, 28, 28), "y": torch.randint(0, 10, (50,)), "num_classes": 10}, cache)
    payload = torch.load(files["good"], weights_only=True)
    payload["config"]["data_cache"] = str(cache)
    champion = tmp_path / "champion.pt"
    torch.save(payload, champion)
    alone, cached = _evaluated([files["good"]], tmp_path)[0], _evaluated([champion], tmp_path)[0]
    assert (alone["samples"], cached["samples"]) == (13, 10)  # 64 and 50 samples, a fifth held out
    assert _evaluated([champion], tmp_path, "--dataset", "synthetic")[0]["samples"] == 13
    challenger, champ = _evaluated([files["good"], champion], tmp_path)
    assert champ["samples"] == challenger["samples"] == 13
    payload["config"] |= {"data_cache": None, "synthetic_size": 100}  # synthetic data is made from its size
    torch.save(payload, champion)
    assert _evaluated([champion], tmp_path)[0]["samples"] == 20
    assert _evaluated([files["good"], champion], tmp_path)[1]["samples"] == 13
