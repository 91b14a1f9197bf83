"""The MLflow tracking store the flows use: where it is, made ready once, and how a run ends.

Only named values are ever logged: never the environment wholesale."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sqlite3
import subprocess
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING

from gpuflow.training.errors import UserError
from gpuflow.training.uris import sqlite_file as sqlite_path

if TYPE_CHECKING:  # MLflow is imported where it is used: this module's defaults need none of it
    from mlflow.tracking import MlflowClient

FLOW_RUN_TAG = "prefect.flow_run_id"  # on every run: finds a flow run's MLflow run


def default_tracking_uri() -> str:
    """MLFLOW_TRACKING_URI, else `mlflow.db` in the working directory (like `runs/` and `data/`)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def require_store(uri: str) -> None:
    """Refuse to read from a SQLite store that does not exist, before anything creates its file."""
    path = sqlite_path(uri)
    if path is not None and not path.is_file():
        raise UserError(f"no MLflow store at {str(path)!r}: nothing has been trained here; run `gpuflow run` in this "
                        "folder first, set MLFLOW_TRACKING_URI (or --tracking-uri) to your store, or pass --checkpoint FILE")


def prepare_store(uri: str) -> MlflowClient:
    """Point MLflow at `uri` and open it (`open_store`)."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    return open_store(uri)


def open_store(uri: str) -> MlflowClient:
    """A client on `uri`; a SQLite store's schema is created and switched to WAL once, under a lock that every process
    opening it this way takes: two processes migrating a new file at once collide ('table ... already exists')."""
    from mlflow.tracking import MlflowClient

    if (db_path := sqlite_path(uri)) is None:
        return MlflowClient(uri)
    db_path.parent.mkdir(parents=True, exist_ok=True)
    with open(db_path.with_name(db_path.name + "-lock"), "a") as lock:  # closing it releases the flock
        fcntl.flock(lock, fcntl.LOCK_EX)  # flows started together would each create tables
        client = MlflowClient(uri)
        client.search_experiments(max_results=1)  # creates the tables if missing
        with sqlite3.connect(db_path, timeout=30) as db:
            db.execute("PRAGMA journal_mode=WAL")  # the relay appends while other runs write: no 'database is locked'
    return client


def checkpoint_wal(uri: str, busy_timeout_s: float = 2.0) -> bool:
    """Move a SQLite store's write-ahead log into its file, so that the file alone holds every run; whether the log
    was emptied (not when another process holds it busy)."""
    path = sqlite_path(uri)
    if path is None or not path.is_file():
        return False
    try:
        with closing(sqlite3.connect(path, timeout=busy_timeout_s)) as db:
            busy, _, _ = db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    except sqlite3.Error:  # locked or unreadable: the data is safe in the log either way
        return False
    return busy == 0


# MLflow 3.17's UI opens in its GenAI mode; what a store can hold for a training user is the experiment's kind (the
# tag its own kind selector writes) and a saved runs view (its "Views" menu): metric columns, sorted by val_loss,
# which every gpuflow run logs, so that sweep trials are listed flat rather than folded under their parent.
EXPERIMENT_KIND_TAG, TRAINING_KIND = "mlflow.experimentKind", "custom_model_development"
TRAINING_VIEW, VIEW_TAG_PREFIX = "gpuflow-training", "mlflow.sharedViewState."
TRAINING_COLUMNS = [f"attributes.`{a}`" for a in ("Source", "Models", "Dataset")] + \
                   [f"metrics.`{m}`" for m in ("val_accuracy", "val_loss", "train_loss")]


def training_view() -> str:
    """The saved view's tag value, as MLflow's UI writes one: an envelope whose `state` is the view's JSON."""
    state = {"selectedColumns": TRAINING_COLUMNS, "orderByKey": "metrics.`val_loss`", "orderByAsc": True}
    return json.dumps({"name": "training runs (gpuflow)", "createdAt": 0, "updatedAt": 0, "state": json.dumps(state)})


def training_tags() -> dict[str, str]:
    """The tags every experiment gpuflow creates or opens carries: its kind and its training view."""
    return {EXPERIMENT_KIND_TAG: TRAINING_KIND, VIEW_TAG_PREFIX + TRAINING_VIEW: training_view()}


def training_view_url(ui_url: str, experiment_id: str) -> str:
    """The experiment's runs in the UI's model-training mode, through its training view (the UI keeps its mode in
    the browser, default GenAI; only the address can choose it)."""
    return f"{ui_url}/#/experiments/{experiment_id}/runs?workflowType=machine_learning&viewStateShareKey={TRAINING_VIEW}"


def ensure_experiment(client: MlflowClient, name: str) -> str:
    """The experiment's id, creating it if needed, tagged for training (`training_tags`); on SQLite its artifacts
    live beside the db."""
    if (exp := client.get_experiment_by_name(name)) is not None:
        for key, value in training_tags().items():  # an experiment made before these tags, or by hand
            if exp.tags.get(key) is None:
                client.set_experiment_tag(exp.experiment_id, key, value)
        return exp.experiment_id
    db = sqlite_path(client.tracking_uri)
    location = str(db.parent / "mlartifacts" / name) if db else None
    from mlflow.exceptions import MlflowException

    try:
        return client.create_experiment(name, artifact_location=location, tags=training_tags())
    except MlflowException:  # created concurrently by another run: use theirs
        return client.get_experiment_by_name(name).experiment_id


def training_view_urls(uri: str, ui_url: str) -> list[str]:
    """`training_view_url` of each experiment of the store at `uri` that gpuflow tagged; none for a SQLite file not
    made yet (reading never creates one)."""
    path = sqlite_path(uri)
    if path is not None and not path.is_file():
        return []
    from mlflow.tracking import MlflowClient

    found = MlflowClient(uri).search_experiments(filter_string=f"tags.`{EXPERIMENT_KIND_TAG}` = '{TRAINING_KIND}'")
    return [training_view_url(ui_url, e.experiment_id) for e in found]


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
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


def end_run(client: MlflowClient, run_id: str, status: str, error: str | None = None) -> None:
    """End `run_id` with `status`; `error` goes to the run's `error` tag (the run is ended even if that fails)."""
    import mlflow

    if error:
        try:
            client.set_tag(run_id, "error", error[:4000])
        except Exception as e:  # noqa: BLE001 - the run still ends, and the error it ends with is what is raised
            logging.getLogger(__name__).warning("run %s: its error tag was not written: %s", run_id, e)
    active = mlflow.active_run()
    if active and active.info.run_id == run_id:
        mlflow.end_run(status)  # also stops this thread's system metrics monitor
    else:
        client.set_terminated(run_id, status)


def withdraw_versions(client: MlflowClient, run_id: str) -> None:
    """Delete the registered versions made from a run that then failed, so none points at a FAILED or KILLED run;
    the run's `gpuflow.withdrawn_versions` tag names them."""
    gone = []
    for mv in client.search_model_versions(f"run_id='{run_id}'"):
        client.delete_model_version(mv.name, mv.version)
        gone.append(f"{mv.name} v{mv.version}")
    if gone:
        client.set_tag(run_id, "gpuflow.withdrawn_versions", ", ".join(gone))
