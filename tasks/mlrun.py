"""MLflow run operations for the flow: store, run, artifacts, registration, status.

Prefect-free, so that the flow's tracker process (tasks/tracker.py) can import it without
Prefect's ~1.2 s: that process runs these on the flow's behalf. They also work in-process
(tests, flows/retrain.py, the flow's fallback when the tracker is gone).
Only named values are logged: never the environment wholesale.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KILLED_EXCEPTIONS = ("KeyboardInterrupt", "TerminationSignal", "Abort", "Cancelled",
                     "CancelledError", "SystemExit", "Terminated")


def import_mlflow_pytorch():
    """`mlflow.pytorch`, without the Lightning autologging it drags in where Lightning is installed.

    `import mlflow.pytorch` ends with `from mlflow.pytorch._lightning_autolog import ...` inside a
    try/except ImportError. With Lightning installed that import alone costs ~2.8 s (measured
    here with lightning 2.x), for a callback the flow never uses. Marking the submodule as absent
    makes it raise ImportError, which mlflow.pytorch swallows. Only when nothing imported it before.
    """
    import sys

    sys.modules.setdefault("mlflow.pytorch._lightning_autolog", None)
    import mlflow.pytorch

    return mlflow.pytorch


def project_root() -> Path:
    """The checkout when run from one (editable install), else the working directory."""
    return ROOT if (ROOT / "pyproject.toml").is_file() else Path.cwd()


def default_tracking_uri() -> str:
    import os

    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{project_root() / 'mlflow.db'}"


def prepare_store(uri: str) -> None:
    """Point MLflow at `uri`; for SQLite create the schema and switch it to WAL once.

    WAL lets the training child append metrics while the flow writes system metrics and
    other runs write theirs, instead of failing with 'database is locked'. Flows started
    together on a new database would each create its tables and collide ('table ... already
    exists'): the creation holds a lock file beside the database (`<db>-lock`).
    """
    import mlflow

    mlflow.set_tracking_uri(uri)
    if uri.startswith("sqlite:///"):
        db_path = Path(uri.removeprefix("sqlite:///"))
        db_path.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive(db_path.with_name(db_path.name + "-lock")):
            mlflow.MlflowClient().search_experiments(max_results=1)  # creates tables if missing
            with sqlite3.connect(db_path, timeout=30) as db:
                db.execute("PRAGMA journal_mode=WAL")


@contextmanager
def _exclusive(lock_path: Path):
    """An exclusive lock between processes on this host (released if the holder dies)."""
    import fcntl

    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=project_root(), capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def flat_params(d: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat_params(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
    return out


def ensure_experiment(name: str) -> str:
    """Set the experiment, creating it if needed; on SQLite its artifacts live beside the db
    (mlartifacts/), not in whatever folder the flow happened to start in."""
    import mlflow

    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name(name)
    if exp is None:
        uri = mlflow.get_tracking_uri()
        location = None
        if uri.startswith("sqlite:///"):
            location = str(Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts" / name)
        try:
            client.create_experiment(name, artifact_location=location)
        except Exception:  # created concurrently by another run: use theirs
            pass
    return mlflow.set_experiment(name).experiment_id


def start_run(experiment: str, run_name: str, params: dict, tags: dict, dataset,
              system_metrics_interval: float = 2.0) -> str:
    """Create the run (active in this thread), log params, tags and the dataset input.

    `dataset`: a mapping or object with name, root, sha256 and num_samples (DatasetInfo).
    """
    import mlflow
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.meta_dataset import MetaDataset

    ds = dataset if isinstance(dataset, dict) else vars(dataset)
    ensure_experiment(experiment)
    mlflow.set_system_metrics_sampling_interval(system_metrics_interval)
    run = mlflow.start_run(run_name=run_name, tags={k: str(v) for k, v in tags.items() if v is not None},
                           log_system_metrics=True)
    try:
        mlflow.log_params(flat_params(params))
        source = CodeDatasetSource({"dataset": ds["name"], "root": str(ds.get("root") or "")})
        log_dataset(MetaDataset(source=source, name=ds["name"], digest=ds["sha256"][:36]),
                    {"samples": str(ds["num_samples"])})
    except BaseException as e:  # never leave a half-started run RUNNING
        end_run(run.info.run_id, e)
        raise
    return run.info.run_id


def log_dataset(ds, tags: dict, attempts: int = 5) -> None:
    """`mlflow.log_input`, retried when a concurrent run inserted the same dataset first.

    MLflow's SQL store looks the (experiment, name, digest) row up and then inserts it, so
    two runs starting together on one store can both miss it and the second insert fails
    the UNIQUE constraint. On the retry the row exists and is linked instead.
    """
    import time

    import mlflow
    from mlflow.exceptions import MlflowException

    for attempt in range(attempts):
        try:
            return mlflow.log_input(ds, context="training", tags=tags)
        except MlflowException as e:
            if "UNIQUE constraint failed" not in str(e) or attempt == attempts - 1:
                raise
            time.sleep(0.05 * (attempt + 1))


def log_json(run_id: str, obj: dict, name: str, folder: str = "environment") -> None:
    import mlflow

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / name
        p.write_text(json.dumps(obj, indent=2, default=str))
        mlflow.MlflowClient().log_artifact(run_id, str(p), folder)


def plot_history(history: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(epochs, [h["train_loss"] for h in history], "o-", label="train loss")
    a.plot(epochs, [h["val_loss"] for h in history], "o-", label="val loss")
    a.set_xlabel("epoch"), a.set_ylabel("cross-entropy"), a.legend(), a.grid(alpha=0.3)
    b.plot(epochs, [h["val_accuracy"] for h in history], "o-", color="tab:green")
    b.set_xlabel("epoch"), b.set_ylabel("validation accuracy"), b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def register_model(run_id: str, checkpoint: str, model_name: str, registered_name: str,
                   num_classes: int, input_shape: list[int]) -> str:
    """Log the de-prefixed checkpoint's model and register it; idempotent per run."""
    from importlib.metadata import version

    import mlflow
    import torch

    from training.checkpoint import load_file, load_model_state
    from training.models import build_model

    client = mlflow.MlflowClient()
    existing = client.search_model_versions(f"name='{registered_name}' and run_id='{run_id}'")
    if existing:  # a retried task must not create a second version
        return existing[0].version
    model = build_model(model_name, num_classes, tuple(input_shape))
    load_model_state(model, load_file(checkpoint)["model"], source=checkpoint)
    reqs = [f"torch=={torch.__version__.split('+')[0]}",
            f"torchvision=={version('torchvision').split('+')[0]}"]
    info = import_mlflow_pytorch().log_model(model.eval(), name="model", registered_model_name=registered_name,
                                             serialization_format="pickle", pip_requirements=reqs)
    return str(info.registered_model_version)


def log_results(run_id: str, result: dict, workdir: str | Path, model_name: str, registered_name: str,
                num_classes: int, input_shape: list[int]) -> str:
    """Log checkpoint, curves, worker logs and the registered model; returns the version."""
    import mlflow

    workdir = Path(workdir)
    client = mlflow.MlflowClient()
    client.set_tag(run_id, "torchrun_restarts", str(result.get("restarts", 0)))
    log_json(run_id, result, "result.json", "training")
    if result.get("checkpoint"):
        client.log_artifact(run_id, result["checkpoint"], "checkpoints")
    if result.get("history"):
        client.log_artifact(run_id, str(plot_history(result["history"], workdir / "curves.png")), "plots")
    if (workdir / "logs").is_dir():
        client.log_artifacts(run_id, str(workdir / "logs"), "worker-logs")
    client.log_artifact(run_id, str(workdir / "config.json"), "training")
    return register_model(run_id, result["checkpoint"], model_name, registered_name,
                          num_classes, input_shape)


def status_for(exc: BaseException | None) -> str:
    if exc is None:
        return "FINISHED"
    return "KILLED" if type(exc).__name__ in KILLED_EXCEPTIONS else "FAILED"


def describe_error(exc: BaseException | None) -> str | None:
    return None if exc is None else f"{type(exc).__name__}: {exc}"[:4000]


def end_run(run_id: str, exc: BaseException | None = None) -> str:
    """Set the terminal status (FINISHED / FAILED / KILLED) and stop system metrics."""
    return finish_run(run_id, status_for(exc), describe_error(exc))


def finish_run(run_id: str, status: str, error: str | None = None) -> str:
    """End `run_id` with `status`; `error` goes to the run's `error` tag."""
    import mlflow

    client = mlflow.MlflowClient()
    if error:
        client.set_tag(run_id, "error", error[:4000])
    active = mlflow.active_run()
    if active and active.info.run_id == run_id:
        mlflow.end_run(status)
    else:
        client.set_terminated(run_id, status)
    return status
