"""The user's own model, data and objective (gpuflow/training/refs.py, builder.py, objective.py).

The user project is examples/myproj copied into a temporary folder with its package renamed
`training`: a project with a `training/` package of its own, as the issue asks, next to
gpuflow's `gpuflow.training`. End-to-end runs start `gpuflow run` from that folder, as a
user does, against the session's Prefect server.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import mlflow
import pytest
import torch

from gpuflow.training import TrainConfig
from gpuflow.training.errors import UserError
from gpuflow.training.preflight import check_user_code
from tests.helpers import user_project

GPUFLOW = Path(sys.executable).parent / "gpuflow"

BLOCK_GPUFLOW = textwrap.dedent("""
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "gpuflow" or name.startswith("gpuflow."):
                raise ImportError("gpuflow is blocked in this process: " + name)
    sys.meta_path.insert(0, Block())
""")


def gpuflow(args: list[str], cwd: Path, api: str, **extra_env: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_API"))}
    env |= {"PREFECT_API_URL": api, **extra_env}
    return subprocess.run([str(GPUFLOW), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def fresh_python(code: str, cwd: Path, block: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", (BLOCK_GPUFLOW if block else "") + textwrap.dedent(code)],
                          cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")})


# --- bad input: refused before any worker starts, naming the reference and the fix ------------


def write(folder: Path, name: str, code: str) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(textwrap.dedent(code))
    return str(folder / name)


GOOD = """
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    class Net(nn.Module):
        def __init__(self, num_classes=3, width=8):
            super().__init__()
            self.fc = nn.Linear(4, num_classes)
        def forward(self, x):
            return self.fc(x)
    def datasets(root):
        x = torch.randn(12, 4)
        return TensorDataset(x, torch.arange(12) % 3), TensorDataset(x[:4], torch.arange(4) % 3)
"""

BAD_ROWS = {  # name: (extra code, config overrides, what the message must say)
    "module not importable": ("", dict(model="nosuchpkg_xyz.nets:Net"), "no module 'nosuchpkg_xyz'"),
    "import error inside the module": ("import not_installed_abc\n", {}, "No module named 'not_installed_abc'"),
    "attribute missing": ("", dict(model="{f}:Nett"), "did you mean Net"),
    "not a module or factory": ("VALUE = 3\n", dict(model="{f}:VALUE"), "not an nn.Module class or a function"),
    "factory returns no module": ("def make():\n    return 3\n", dict(model="{f}:make"), "returned a int, not an nn.Module"),
    "factory raises": ("def make():\n    raise ValueError('no weights here')\n", dict(model="{f}:make"),
                       "ValueError: no weights here"),
    "wrong model_args": ("", dict(model_args={"widht": 3}), "unexpected keyword argument 'widht'"),
    "datasets not two": ("def one(root):\n    return [1, 2, 3]\n", dict(dataset="{f}:one"), "returned a list of 3"),
    "empty dataset": ("def empty(root):\n    return TensorDataset(torch.zeros(0, 4), torch.zeros(0)), "
                      "TensorDataset(torch.zeros(1, 4), torch.zeros(1))\n", dict(dataset="{f}:empty"),
                      "its train set is empty"),
    "sample the model cannot take": (
        "def wide(root):\n    x = torch.randn(6, 5)\n    return TensorDataset(x, torch.arange(6) % 3), "
        "TensorDataset(x, torch.arange(6) % 3)\n", dict(dataset="{f}:wide"), "inputs (2, 5) float32"),
    "labels outside the outputs": (
        "def big(root):\n    x = torch.randn(6, 4)\n    return TensorDataset(x, torch.arange(6)), "
        "TensorDataset(x, torch.arange(6))\n", dict(dataset="{f}:big"), "labels run 0..5, outside the model's 3"),
    "more outputs than the labels use": ("", dict(model_args={"num_classes": 10}),
                                         "the model outputs 10 class scores but the labels run 0..2 (3 classes)"),
    "loss not a scalar": ("def per_sample(out, y):\n    return (out - 1).abs().sum(1)\n",
                          dict(objective="{f}:per_sample"), "loss returned shape (2,)"),
}


@pytest.mark.parametrize("row", list(BAD_ROWS))
def test_bad_user_code_is_refused_in_preflight_with_its_cause(row, tmp_path):
    extra, overrides, message = BAD_ROWS[row]
    f = write(tmp_path / row.replace(" ", "_"), "proj.py", textwrap.dedent(GOOD) + extra)
    fields = {"model": "{f}:Net", "dataset": "{f}:datasets", **overrides}
    fields = {k: v.format(f=f) if isinstance(v, str) else v for k, v in fields.items()}
    with pytest.raises(UserError) as e:
        check_user_code(TrainConfig(**fields, code_root=str(tmp_path), data_root=str(tmp_path)), world_size=2)
    assert message in str(e.value), str(e.value)
    assert any(repr(v) in str(e.value) or f" {v} " in str(e.value) for v in fields.values() if isinstance(v, str)), \
        f"the message names no reference: {e.value}"


def test_a_good_user_project_passes_preflight_and_reports_its_classes(tmp_path):
    f = write(tmp_path, "proj.py", GOOD)
    out = check_user_code(TrainConfig(model=f"{f}:Net", dataset=f"{f}:datasets", code_root=str(tmp_path)))
    assert out == {"num_classes": 3, "output_shape": [3]}


def test_references_are_checked_at_declaration():
    with pytest.raises(ValueError, match="no Python file"):
        TrainConfig(model="./missing.py:Net")
    with pytest.raises(ValueError, match="names no attribute"):
        TrainConfig(model="myproj.nets:")
    with pytest.raises(ValueError, match="model_args apply to a model of your own"):
        TrainConfig(model="mlp", model_args={"width": 3})


def test_a_refused_user_model_is_one_line_and_leaves_no_run(tmp_path, api_url):
    proj = user_project(tmp_path / "proj")
    out = gpuflow(["run", "--model", "training.nets:Nett", "--dataset", "training.data:datasets", "--epochs", "1"],
                  proj, api_url)
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("gpuflow run: model 'training.nets:Nett'") and "did you mean Net" in last, last
    assert "Traceback" not in out.stderr
    assert not (proj / "mlflow.db").exists()  # refused before the MLflow run


# --- the served-deployment allowlist ------------------------------------------------------


def test_served_runs_name_only_allowed_packages_and_folders(tmp_path, monkeypatch):
    from gpuflow.flows import allow
    from gpuflow.flows.params import PipelineParams
    from gpuflow.flows.settings import Settings

    monkeypatch.chdir(tmp_path)
    shutil.copytree(Path(__file__).resolve().parents[1] / "examples" / "myproj" / "myproj", tmp_path / "myproj")
    monkeypatch.syspath_prepend(str(tmp_path))  # serve's folder holds the allowed package
    f = write(tmp_path / "inside", "nets.py", GOOD)
    outside = write(tmp_path.parent / f"{tmp_path.name}-outside", "nets.py", GOOD)
    settings = Settings(allow_code="myproj", allow_paths=str(tmp_path))
    params = PipelineParams(model="myproj.nets:Net", dataset=f"{f}:datasets")
    allow.check_allowed(params, settings)  # a local run: never checked
    monkeypatch.setattr(allow.deployment, "get_id", lambda: "a-deployment-id")
    allow.check_allowed(params, settings)  # allowed package, file inside the allowed folder
    refused = {
        "package 'myproj_evil' is not allowed": PipelineParams(model="myproj_evil.nets:Net"),
        "package 'os' is not allowed": PipelineParams(objective="os:system"),
        "is outside the folders": PipelineParams(model=f"{outside}:Net"),
        "data_root='/etc' is outside": PipelineParams(data_root="/etc"),
        "runs_dir='/tmp/elsewhere' is outside": PipelineParams(runs_dir="/tmp/elsewhere"),
    }
    for message, bad in refused.items():
        with pytest.raises(allow.NotAllowed, match=message.replace("(", r"\(")):
            allow.check_allowed(bad, settings)
    with pytest.raises(allow.NotAllowed, match="allowed: none"):
        allow.check_allowed(PipelineParams(model="myproj.nets:Net"), Settings())
    for name in [m for m in sys.modules if m == "myproj" or m.startswith("myproj.")]:
        del sys.modules[name]  # this copy of the package was this test's alone


# --- end to end: DDP with 2 gloo processes, 1 vs 2 equal, checkpoint, registry ---------------


@pytest.fixture(scope="module")
def api_url(prefect_api):
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


JOBS = {"classifier": ["--model", "training.nets:Net", "--model-args", '{"width": 32}',
                       "--dataset", "training.data:datasets", "--epochs", "2", "--strategy", "ddp"],
        "regression": ["--model", "training.regression:Regressor", "--dataset", "training.regression:datasets",
                       "--objective", "training.regression:MSE", "--epochs", "2", "--strategy", "ddp"]}
REGISTERED = {"classifier": "blobs", "regression": "points"}


def stored(store: Path) -> list[str]:
    return ["--tracking-uri", f"sqlite:///{store / 'mlflow.db'}", "--runs-dir", str(store / "runs")]


def run_json(args: list[str], cwd: Path, api: str, **extra_env: str) -> dict:
    """`gpuflow <args>` from cwd; its JSON report."""
    out = gpuflow(args, cwd, api, **extra_env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout[out.stdout.index("{"):])


@pytest.fixture(scope="module")
def trained(api_url, tmp_path_factory):
    """The classifier and the regression, each with 1 and 2 processes, from the user's folder."""
    base = tmp_path_factory.mktemp("user")
    proj = user_project(base / "proj")
    store = base / "store"  # outside the project: the project folder moves later
    runs = {}
    for job, args in JOBS.items():
        for procs in (1, 2):
            runs[job, procs] = run_json(["run", *args, "--registered-model", REGISTERED[job], "--cpu-processes",
                                         str(procs), *stored(store)], proj, api_url)
    mlflow.set_tracking_uri(f"sqlite:///{store / 'mlflow.db'}")
    return base, proj, store, runs


def test_user_models_train_under_ddp_with_equal_metrics_on_1_and_2_processes(trained):
    *_, runs = trained
    for job, keys in (("classifier", ("train_loss", "val_loss", "val_accuracy")),
                      ("regression", ("train_loss", "val_loss", "val_mae", "val_r2"))):
        one, two = runs[job, 1], runs[job, 2]
        assert (one["status"], two["status"], two["world_size"]) == ("FINISHED", "FINISHED", 2)
        for k in keys:
            assert one["final_metrics"][k] == pytest.approx(two["final_metrics"][k], rel=1e-4, abs=1e-6), (job, k)
    assert runs["classifier", 2]["final_metrics"]["val_accuracy"] > 0.6  # chance is 1/3
    run = mlflow.MlflowClient().get_run(runs["classifier", 2]["run_id"])
    assert run.data.params["model"] == "training.nets:Net" and run.data.params["model_args.width"] == "32"


def test_the_checkpoint_loads_strict_into_the_users_own_class(trained):
    _, proj, store, runs = trained
    run_id = runs["classifier", 2]["run_id"]
    ck = sorted((store / "runs" / run_id / "checkpoints").glob("epoch-*.pt"))[-1]
    out = fresh_python(f"""
        import torch
        from training.nets import Net
        ck = torch.load({str(ck)!r}, weights_only=True)
        assert ck["model_spec"] == {{"reference": "training.nets:Net", "kwargs": {{"width": 32, "num_classes": 3,
                                    "input_shape": [8]}}}}, ck["model_spec"]
        Net(**ck["model_spec"]["kwargs"]).load_state_dict(ck["model"], strict=True)
        print("loaded")
    """, cwd=proj)
    assert out.returncode == 0 and "loaded" in out.stdout, out.stderr[-2000:]


def test_prepare_data_ran_once_in_the_flow_and_ranks_only_opened_it(trained):
    _, proj, *_ = trained
    assert torch.load(proj / "data" / "myproj-blobs.pt", weights_only=True)["x"].shape == (900, 8)


def test_gpuflow_evaluate_and_infer_run_user_models_from_the_users_folder(trained, api_url):
    """The evaluation child imports the user's `training` package, not gpuflow's."""
    base, proj, store, runs = trained
    uri = ["--tracking-uri", f"sqlite:///{store / 'mlflow.db'}", "--gpus", "cpu"]
    ev = run_json(["evaluate", "--registered-model", "points", "--version", "2", *uri], proj, api_url)
    final = runs["regression", 2]["final_metrics"]
    assert (ev["monitor"], ev["mode"], ev["samples"]) == ("mae", "min", 201)
    for k in ("loss", "mae", "r2"):  # the same weights on the same split as training's last validation
        assert ev[k] == pytest.approx(final[f"val_{k}"], rel=1e-4), k
    data = torch.load(proj / "data" / "myproj-blobs.pt", weights_only=True)
    torch.save({"inputs": data["x"][750:]}, base / "val-inputs.pt")
    out = run_json(["infer", "--registered-model", "blobs", "--version", "2", "--inputs",
                    str(base / "val-inputs.pt"), *uri], proj, api_url)
    hits = (torch.tensor(out["predictions"]) == data["y"][750:]).float().mean().item()
    assert hits == pytest.approx(runs["classifier", 2]["final_metrics"]["val_accuracy"], abs=1e-6)


def test_a_user_model_killed_mid_epoch_resumes_and_ends_as_the_uninterrupted_run(trained, api_url):
    base, proj, store, runs = trained
    out = run_json(["run", *JOBS["classifier"], "--cpu-processes", "2", "--max-restarts", "1",
                    "--registered-model", "blobs-restarted", *stored(base / "restarted")], proj, api_url,
                   GPUFLOW_FAULT="rank=1,epoch=2,restart=0,step=2")
    assert out["status"] == "FINISHED" and out["restarts"] == 1 and out["resumed_from"].endswith("epoch-0001.pt")
    a = torch.load(out["checkpoint"], weights_only=True)["model"]
    b = torch.load(runs["classifier", 2]["checkpoint"], weights_only=True)["model"]
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k


def test_the_retrain_flow_compares_user_models_on_their_objectives_metric(trained, api_url):
    base, proj, *_ = trained
    store = base / "retrain"
    code = f"""
        import json
        from gpuflow.flows.retrain import retrain
        common = dict(model="training.regression:Regressor", dataset="training.regression:datasets",
                      objective="training.regression:MSE", gpus="cpu", registered_model="pts",
                      tracking_uri={f"sqlite:///{store / 'mlflow.db'}"!r}, runs_dir={str(store / "runs")!r})
        first = retrain(**common, epochs=2)
        second = retrain(**common, epochs=1, lr=1e-6)  # barely trained: a worse challenger
        print(json.dumps([first, second]))
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_API"))}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=proj, capture_output=True, text=True,
                         timeout=600, env=env | {"PREFECT_API_URL": api_url})
    assert out.returncode == 0, out.stderr[-3000:]
    first, second = json.loads(out.stdout.strip().splitlines()[-1])
    assert first["promoted"] and first["retrain.metric"] == "mae"  # the objective's monitor, auto
    assert not second["promoted"] and second["retrain.decision"] == "kept champion"
    assert float(second["retrain.challenger_score"]) > float(second["retrain.champion_score"])  # mae: lower wins
    shutil.copyfile(store / "mlflow.db", base / "retrain-copy.db")  # the file alone, without its -wal
    for db in (store / "mlflow.db", base / "retrain-copy.db"):
        client = mlflow.MlflowClient(f"sqlite:///{db}")
        assert str(client.get_model_version_by_alias("pts", "champion").version) == "1"
        assert client.get_model_version("pts", "2").tags["gpuflow.outcome"].startswith("rejected")


def test_registered_user_models_predict_in_a_fresh_process_without_gpuflow_after_the_project_moved(trained):
    base, proj, store, _ = trained
    shutil.move(proj, base / "moved")  # the code comes from the model itself now
    try:
        _predict_elsewhere(base, store)
    finally:
        shutil.move(base / "moved", proj)


def _predict_elsewhere(base: Path, store: Path) -> None:
    elsewhere = base / "elsewhere"
    elsewhere.mkdir()
    out = fresh_python(f"""
        import mlflow, numpy as np
        mlflow.set_tracking_uri({f"sqlite:///{store / 'mlflow.db'}"!r})
        blobs = mlflow.pyfunc.load_model("models:/blobs/2")
        scores = blobs.predict(blobs.input_example)
        assert scores.shape == (2, 3), scores.shape
        assert type(blobs.unwrap_python_model().model).__name__ == "Net"
        points = mlflow.pyfunc.load_model("models:/points/2")
        assert points.predict(points.input_example).shape == (2, 1)
        print("predicted", sorted(points.input_example))
    """, cwd=elsewhere)
    assert out.returncode == 0 and "predicted ['x']" in out.stdout, out.stderr[-3000:]
    # and in a process that imported gpuflow's own (namespaced) training package first
    out = fresh_python(f"""
        import gpuflow.training, mlflow
        mlflow.set_tracking_uri({f"sqlite:///{store / 'mlflow.db'}"!r})
        m = mlflow.pyfunc.load_model("models:/blobs/1")
        print(m.predict(m.input_example).shape)
    """, cwd=elsewhere, block=False)
    assert out.returncode == 0 and "(2, 3)" in out.stdout, out.stderr[-3000:]
