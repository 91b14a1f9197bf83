"""The flow's MLflow run, all of it in the flow's own process.

`tracked_run()` owns one run per flow run: it creates it (after marking KILLED any run of this
host whose owner process is gone), relays rank 0's per-epoch metrics file to it with a thread
while the launch runs, and always ends it FINISHED, FAILED or KILLED. `log_results` adds the
checkpoint, curves, logs and the registered model. Only named values are logged: never the
environment wholesale. The ranks never import MLflow.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import socket
import sqlite3
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import mlflow
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient
from prefect import task
from prefect.cache_policies import NO_CACHE

from gpuflow.training.metrics import parse_line

OWNER_HOST, OWNER_PID, OWNER_STARTED = "gpuflow.owner.host", "gpuflow.owner.pid", "gpuflow.owner.started"
FLOW_RUN_TAG = "prefect.flow_run_id"


# --- the store ----------------------------------------------------------------------------


def default_tracking_uri() -> str:
    """MLFLOW_TRACKING_URI, else `mlflow.db` in the working directory (like `runs/` and `data/`)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def prepare_store(uri: str) -> MlflowClient:
    """Point MLflow at `uri`; for SQLite create the schema and switch it to WAL once.

    WAL lets the relay append metrics while system metrics and other runs write theirs,
    instead of failing with 'database is locked'. Flows started together on a new database
    would each create its tables and collide: creation holds a lock file beside it.
    """
    mlflow.set_tracking_uri(uri)
    if not uri.startswith("sqlite:///"):
        return MlflowClient(uri)
    db_path = Path(uri.removeprefix("sqlite:///"))
    db_path.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(db_path.with_name(db_path.name + "-lock")):
        client = MlflowClient(uri)
        client.search_experiments(max_results=1)  # creates the tables if missing
        with sqlite3.connect(db_path, timeout=30) as db:
            db.execute("PRAGMA journal_mode=WAL")
    return client


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


def ensure_experiment(client: MlflowClient, name: str) -> str:
    """The experiment's id, creating it if needed; on SQLite its artifacts live beside the db."""
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    uri = client.tracking_uri
    location = None
    if uri.startswith("sqlite:///"):
        location = str(Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts" / name)
    try:
        return client.create_experiment(name, artifact_location=location)
    except mlflow.exceptions.MlflowException:  # created concurrently by another run: use theirs
        return client.get_experiment_by_name(name).experiment_id


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def flat_params(d: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flat_params(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, (list, tuple, dict)) else str(v)
    return out


# --- who owns a run: runs left RUNNING by a dead owner are marked KILLED -----------------


def owner_tags() -> dict[str, str]:
    """This process as a run's owner: host, pid and start time (a reused pid is not alive)."""
    import psutil

    return {OWNER_HOST: socket.gethostname(), OWNER_PID: str(os.getpid()),
            OWNER_STARTED: f"{psutil.Process().create_time():.3f}"}


def owner_alive(tags: dict[str, str]) -> bool:
    import psutil

    try:
        proc = psutil.Process(int(tags[OWNER_PID]))
        return abs(proc.create_time() - float(tags[OWNER_STARTED])) < 0.01
    except (KeyError, ValueError, psutil.NoSuchProcess):
        return False


def reap_orphaned_runs(client: MlflowClient) -> list[str]:
    """Mark KILLED every RUNNING run of this host whose owner process is gone; their ids."""
    host = socket.gethostname()
    ids = [e.experiment_id for e in client.search_experiments()]
    if not ids:
        return []
    found = client.search_runs(ids, f"attributes.status = 'RUNNING' and tags.`{OWNER_HOST}` = '{host}'")
    reaped = []
    for run in found:
        if owner_alive(run.data.tags):
            continue
        end_run(client, run.info.run_id, "KILLED",
                f"its owner (pid {run.data.tags.get(OWNER_PID)} on {host}) ended without ending the "
                "run (killed or crashed); marked KILLED by the next gpuflow run on this host")
        reaped.append(run.info.run_id)
    return reaped


def end_flow_run_mlflow_runs(flow, flow_run, state) -> None:
    """Prefect state hook (on_crashed, on_cancellation): end the flow run's MLflow run KILLED.

    For a served run whose process was killed or cancelled: Prefect's runner calls this in its
    own process, where the flow's `finally` never ran.
    """
    uri = (flow_run.parameters or {}).get("tracking_uri") or default_tracking_uri()
    client = MlflowClient(uri)
    ids = [e.experiment_id for e in client.search_experiments()]
    if not ids:
        return
    runs = client.search_runs(ids, f"attributes.status = 'RUNNING' and tags.`{FLOW_RUN_TAG}` = '{flow_run.id}'")
    for run in runs:
        end_run(client, run.info.run_id, "KILLED",
                f"Prefect flow run {flow_run.name} ended {state.name}: {state.message or 'no message'}")


# --- status ------------------------------------------------------------------------------


def status_for(exc: BaseException | None) -> str:
    """FINISHED without an error; KILLED for a stop from outside (signal, cancel); else FAILED."""
    from prefect.exceptions import Abort, TerminationSignal

    if exc is None:
        return "FINISHED"
    stops = (KeyboardInterrupt, SystemExit, TerminationSignal, Abort, asyncio.CancelledError,
             concurrent.futures.CancelledError)
    return "KILLED" if isinstance(exc, stops) else "FAILED"


def describe_stop(exc: BaseException) -> str:
    """The run's `error` tag: what stopped it, in words a user recognises."""
    from prefect.exceptions import TerminationSignal

    if isinstance(exc, KeyboardInterrupt):
        return "stopped by Ctrl-C (SIGINT) to the flow"
    if isinstance(exc, TerminationSignal):
        return (f"stopped by {signal.Signals(exc.signal).name} to the flow (a timeout, systemd, a "
                "container stop, a cancellation)")
    if isinstance(exc, SystemExit):
        return f"stopped: the flow process exited with code {exc.code}"
    return f"{type(exc).__name__}: {exc}"


def end_run(client: MlflowClient, run_id: str, status: str, error: str | None = None) -> str:
    """End `run_id` with `status`; `error` goes to the run's `error` tag."""
    if error:
        client.set_tag(run_id, "error", error[:4000])
    active = mlflow.active_run()
    if active and active.info.run_id == run_id:
        mlflow.end_run(status)  # also stops this thread's system metrics monitor
    else:
        client.set_terminated(run_id, status)
    return status


# --- live metrics ------------------------------------------------------------------------


class MetricsRelay(threading.Thread):
    """Logs the lines rank 0 appends to its metrics file to the run, while the launch runs.

    Complete lines only, one synchronous log_batch each; polls every `interval` seconds and
    reads the file to its end once more when stopped, so no epoch written before is lost.
    """

    def __init__(self, client: MlflowClient, run_id: str, path: Path, interval: float = 0.5):
        super().__init__(name="gpuflow-metrics-relay", daemon=True)
        self.client, self.run_id, self.path, self.interval = client, run_id, path, interval
        self.offset = path.stat().st_size if path.exists() else 0  # this run's lines only
        self.logged = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while True:
            stopping = self._halt.wait(self.interval)
            self._pump()
            if stopping:
                return

    def _pump(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        complete = data[:data.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.splitlines():
            try:
                step, ts, metrics = parse_line(line)
                batch = [Metric(k, v, ts, step) for k, v in metrics.items()]
                self.client.log_batch(self.run_id, metrics=batch, synchronous=True)
                self.logged += 1
            except Exception as e:  # noqa: BLE001 - one bad line must not lose the others
                print(f"gpuflow: could not log metrics line {line[:200]!r}: {type(e).__name__}: {e}",
                      flush=True)

    def finish(self) -> int:
        """Stop after logging everything in the file now; returns the lines logged."""
        self._halt.set()
        self.join()
        return self.logged


# --- the run -----------------------------------------------------------------------------


@dataclass
class TrackedRun:
    """The flow's open MLflow run and its folder (config, checkpoints, metrics file, logs)."""

    client: MlflowClient
    run_id: str
    experiment_id: str
    workdir: Path

    @property
    def metrics_file(self) -> Path:
        return self.workdir / "metrics.jsonl"

    def log_params(self, params: dict) -> None:
        self.client.log_batch(self.run_id, params=[mlflow.entities.Param(k, v) for k, v in
                                                   flat_params(params).items()], synchronous=True)

    def log_metrics(self, metrics: dict[str, float]) -> None:
        ts = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), ts, 0) for k, v in metrics.items()],
                              synchronous=True)

    def log_json(self, obj, name: str, folder: str) -> None:
        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / name
            p.write_text(json.dumps(obj, indent=2, default=str))
            self.client.log_artifact(self.run_id, str(p), folder)

    @contextmanager
    def relaying_metrics(self) -> Iterator[MetricsRelay]:
        """Relay rank 0's metrics file to the run for the duration of the block."""
        relay = MetricsRelay(self.client, self.run_id, self.metrics_file)
        relay.start()
        try:
            yield relay
        finally:
            relay.finish()


@contextmanager
def tracked_run(uri: str, experiment: str, run_name: str, tags: dict, dataset: dict,
                runs_dir: str | Path, system_metrics_interval: float = 2.0) -> Iterator[TrackedRun]:
    """One MLflow run around the block, ended FINISHED, FAILED or KILLED whatever happens.

    The run's folder is `<runs_dir>/<run id>`. Before starting, runs of this host left
    RUNNING by a process that is gone are marked KILLED.
    """
    client = prepare_store(uri)
    reap_orphaned_runs(client)
    exp_id = ensure_experiment(client, experiment)
    mlflow.set_system_metrics_sampling_interval(system_metrics_interval)
    all_tags = {**{k: str(v) for k, v in tags.items() if v is not None}, **owner_tags()}
    run = mlflow.start_run(experiment_id=exp_id, run_name=run_name, tags=all_tags, log_system_metrics=True)
    status, error = "FINISHED", None
    try:
        log_dataset(dataset)
        workdir = Path(runs_dir).resolve() / run.info.run_id
        workdir.mkdir(parents=True, exist_ok=True)
        yield TrackedRun(client, run.info.run_id, exp_id, workdir)
    except BaseException as e:
        status, error = status_for(e), describe_stop(e)
        raise
    finally:
        end_run(client, run.info.run_id, status, error)


def log_dataset(ds: dict, attempts: int = 5) -> None:
    """The dataset as the active run's input, retried when a concurrent run inserted it first.

    MLflow's SQL store looks the (experiment, name, digest) row up and then inserts it, so two
    runs starting together can both miss it and the second insert fails the UNIQUE constraint.
    """
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.meta_dataset import MetaDataset

    source = CodeDatasetSource({"dataset": ds["name"], "root": str(ds.get("root") or "")})
    meta = MetaDataset(source=source, name=ds["name"], digest=ds["sha256"][:36])
    for attempt in range(attempts):
        try:
            return mlflow.log_input(meta, context="training", tags={"samples": str(ds["num_samples"])})
        except mlflow.exceptions.MlflowException as e:
            if "UNIQUE constraint failed" not in str(e) or attempt == attempts - 1:
                raise
            time.sleep(0.05 * (attempt + 1))


# --- results -----------------------------------------------------------------------------


def plot_history(history: list[dict], out: Path) -> Path:
    """Loss and accuracy curves as a PNG. matplotlib's object API: no pyplot state shared
    between flows running in threads, and half pyplot's import time."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    epochs = [h["epoch"] for h in history]
    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    a, b = fig.subplots(1, 2)
    a.plot(epochs, [h["train_loss"] for h in history], "o-", label="train loss")
    a.plot(epochs, [h["val_loss"] for h in history], "o-", label="val loss")
    a.set_xlabel("epoch"), a.set_ylabel("cross-entropy"), a.legend(), a.grid(alpha=0.3)
    b.plot(epochs, [h["val_accuracy"] for h in history], "o-", color="tab:green")
    b.set_xlabel("epoch"), b.set_ylabel("validation accuracy"), b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    return out


def register_model(run: TrackedRun, checkpoint: str, registered_name: str, num_classes: int,
                   input_shape: list[int]) -> str:
    """Log the checkpoint as a pyfunc model from code (tasks/registered_model.py) and register
    it; idempotent per run. Needs no torch here: the model is built only where it is loaded."""
    from importlib.metadata import version

    import numpy as np
    from mlflow.models.signature import ModelSignature
    from mlflow.types.schema import Schema, TensorSpec

    existing = run.client.search_model_versions(f"name='{registered_name}' and run_id='{run.run_id}'")
    if existing:  # a retried task must not create a second version
        return existing[0].version
    active = mlflow.active_run()
    if active is None or active.info.run_id != run.run_id:
        raise RuntimeError(f"register_model must run in the thread that owns run {run.run_id}")
    signature = ModelSignature(inputs=Schema([TensorSpec(np.dtype(np.float32), (-1, *input_shape))]),
                               outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, num_classes))]))
    reqs = [f"{pkg}=={version(pkg).split('+')[0]}" for pkg in ("torch", "torchvision", "mlflow", "numpy")]
    info = mlflow.pyfunc.log_model(
        name="model", python_model=str(Path(__file__).with_name("registered_model.py")),
        artifacts={"checkpoint": checkpoint}, signature=signature, pip_requirements=reqs,
        registered_model_name=registered_name)
    return str(info.registered_model_version)


@task(name="log-results", cache_policy=NO_CACHE)
def log_results(run: TrackedRun, result: dict, registered_name: str, num_classes: int,
                input_shape: list[int]) -> str:
    """Log checkpoint, curves, worker logs and the registered model; returns the version."""
    client, run_id, workdir = run.client, run.run_id, run.workdir
    client.set_tag(run_id, "torchrun_restarts", str(result.get("restarts", 0)))
    run.log_json(result, "result.json", "training")
    if result.get("checkpoint"):
        client.log_artifact(run_id, result["checkpoint"], "checkpoints")
    if result.get("history"):
        client.log_artifact(run_id, str(plot_history(result["history"], workdir / "curves.png")), "plots")
    if (workdir / "logs").is_dir():
        client.log_artifacts(run_id, str(workdir / "logs"), "worker-logs")
    client.log_artifact(run_id, str(workdir / "config.json"), "training")
    return register_model(run, result["checkpoint"], registered_name, num_classes, input_shape)
