"""The flow's MLflow run, in the flow's own process: `tracked_run()` owns one run per flow run, relays rank 0's
metrics file to it while the launch runs, and always ends it. The ranks never import MLflow.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import mlflow
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from gpuflow.training.contract import RunFolder
from gpuflow.training.metrics import parse_line

from .orphans import owner_tags, reap_orphaned_runs
from .store import checkpoint_wal, end_run, ensure_experiment, flat_params, prepare_store, withdraw_versions
from .watcher import watch_run


def status_for(exc: BaseException) -> str:
    """KILLED for a stop from outside (signal, cancel), else FAILED."""
    from prefect.exceptions import Abort, TerminationSignal

    from gpuflow.tasks.child import Stopped

    stops = (KeyboardInterrupt, SystemExit, TerminationSignal, Abort, asyncio.CancelledError,
             concurrent.futures.CancelledError, Stopped)
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
    if api_lost(exc):
        return lost_api_message(exc)
    return f"{type(exc).__name__}: {exc}"


def api_lost(exc: BaseException) -> bool:
    """Whether `exc` is the Prefect API (or any HTTP peer of the flow) no longer answering."""
    import httpx

    return isinstance(exc, httpx.TransportError)


def lost_api_message(exc: BaseException) -> str:
    from prefect.settings import PREFECT_API_URL

    return (f"the Prefect API at {PREFECT_API_URL.value() or '(temporary)'} stopped answering "
            f"({type(exc).__name__}: {exc}); the run is not registered. Check the server and start the run again")


class MetricsRelay(threading.Thread):
    """Logs the complete lines rank 0 appends to its metrics file to the run, every `LOG_S` seconds and once
    more when stopped. `on_metrics(step, metrics)` (a sweep's pruner) sees each line as soon as it is read, every
    `ON_METRICS_S`; the lines are still logged in batches, every `LOG_S`. Each metric is logged once per step: a
    restarted rank 0 reporting steps again (resumed from an older checkpoint, or from scratch) adds no second point
    at a step the run has (the first value stays; the console names those dropped)."""

    LOG_S = 0.5
    ON_METRICS_S = 0.05  # a pruned trial stops within an epoch however short its epochs

    def __init__(self, client: MlflowClient, run_id: str, path: Path,
                 on_metrics: Callable[[int, dict], None] | None = None, checkpoints: Path | None = None):
        super().__init__(name="gpuflow-metrics-relay", daemon=True)
        self.client, self.run_id, self.path = client, run_id, path
        self.offset = path.stat().st_size if path.exists() else 0  # this run's lines only
        self.logged = 0
        self.on_metrics = on_metrics
        self.checkpoints, self.uploaded = checkpoints, set()
        self.pending: list[tuple] = []
        self.steps: dict[str, set[int]] | None = None  # metric: the steps the run has, read when the relay starts
        self._halt = threading.Event()

    def run(self) -> None:
        self.steps = self._logged_steps()
        last, stopping = time.monotonic(), False
        while not stopping:
            stopping = self._halt.wait(self.ON_METRICS_S if self.on_metrics else self.LOG_S)
            self._read()
            if stopping or time.monotonic() - last >= self.LOG_S:
                self._log()
                last = time.monotonic()

    def _logged_steps(self) -> dict[str, set[int]]:
        """The steps of each metric the run has already (a resumed run's, an earlier round's); system metrics aside."""
        try:
            keys = [k for k in self.client.get_run(self.run_id).data.metrics if not k.startswith("system/")]
            return {k: {m.step for m in self.client.get_metric_history(self.run_id, k)} for k in keys}
        except Exception as e:  # noqa: BLE001 - the relay still runs; only this run's own repeats are dropped
            print(f"gpuflow: the run's logged steps were not read ({type(e).__name__}: {e})", flush=True)
            return {}

    def _new(self, lines: list[tuple]) -> list[Metric]:
        """The lines' metrics at steps the run does not have yet; the others named once on the console."""
        fresh, again = [], {}
        for step, ts, metrics in lines:
            for k, v in metrics.items():
                seen = self.steps.setdefault(k, set())
                if step in seen:
                    again.setdefault(k, []).append(step)
                else:
                    seen.add(step)
                    fresh.append(Metric(k, v, ts, step))
        if again:
            named = "; ".join(f"{k} at step {', '.join(map(str, sorted(set(s))))}" for k, s in again.items())
            print(f"gpuflow: reported again, not logged twice (a restart ran them again; the first values stay): "
                  f"{named}"[:2000], flush=True)
        return fresh

    def _log(self) -> None:
        lines, self.pending = self.pending, []
        if not lines:
            return
        try:
            self.client.log_batch(self.run_id, metrics=self._new(lines), synchronous=True)
            self.logged += len(lines)
        except Exception as e:  # noqa: BLE001 - the run goes on; the loss is said
            print(f"gpuflow: could not log {len(lines)} metrics line(s) (steps {lines[0][0]}-{lines[-1][0]}): "
                  f"{type(e).__name__}: {e}", flush=True)

    def _read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        complete = data[:data.rfind(b"\n") + 1]
        self.offset += len(complete)
        self._upload_checkpoints()  # after reading the lines: each epoch read has its checkpoint written
        lines = []
        for line in complete.splitlines():
            try:
                lines.append(parse_line(line))
            except Exception as e:  # noqa: BLE001 - one bad line must not lose the others
                print(f"gpuflow: could not read metrics line {line[:200]!r}: {type(e).__name__}: {e}", flush=True)
        for step, _, metrics in lines if self.on_metrics is not None else []:
            try:
                self.on_metrics(step, metrics)
            except Exception as e:  # noqa: BLE001 - the listener's failure must not lose the metrics
                print(f"gpuflow: metrics of step {step} not handed on: {type(e).__name__}: {e}", flush=True)
        self.pending += lines

    def _upload_checkpoints(self) -> None:
        """Upload each new complete epoch checkpoint before its metrics: a replacement resumes any logged one."""
        if self.checkpoints is None or not self.checkpoints.is_dir():
            return
        for p in sorted(self.checkpoints.glob("epoch-*.pt")):  # a write in progress is a hidden .tmp
            if p.name not in self.uploaded:
                try:
                    self.client.log_artifact(self.run_id, str(p), "checkpoints")
                    self.uploaded.add(p.name)
                except Exception as e:  # noqa: BLE001 - the run goes on; a replacement resumes from an older one
                    print(f"gpuflow: could not upload {p.name}: {type(e).__name__}: {e}", flush=True)

    def finish(self) -> None:
        """Stop after logging everything in the file now."""
        self._halt.set()
        self.join()


@dataclass
class TrackedRun:
    """The flow's open MLflow run and its folder (config, checkpoints, metrics file, logs)."""

    client: MlflowClient
    run_id: str
    experiment_id: str
    workdir: Path

    @property
    def metrics_file(self) -> Path:
        return RunFolder(self.workdir).metrics

    def log_params(self, params: dict) -> None:
        self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in flat_params(params).items()],
                              synchronous=True)

    def log_metrics(self, metrics: dict[str, float]) -> None:
        ts = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), ts, 0) for k, v in metrics.items()],
                              synchronous=True)

    def log_json(self, obj, name: str, folder: str) -> None:
        self.client.log_dict(self.run_id, obj, f"{folder}/{name}")  # name ends in .json: json.dump, indent 2

    @contextmanager
    def relaying_metrics(self, on_metrics: Callable[[int, dict], None] | None = None,
                         checkpoints: Path | None = None) -> Iterator[MetricsRelay]:
        """Relay rank 0's metrics file (and, given, the `checkpoints` folder's new epochs) to the run for the block."""
        relay = MetricsRelay(self.client, self.run_id, self.metrics_file, on_metrics, checkpoints)
        relay.start()
        try:
            yield relay
        finally:
            relay.finish()


SYSTEM_METRICS_S = 2.0  # how often the run's system metrics are sampled (a run of seconds still gets a few)


@contextmanager
def tracked_run(uri: str, experiment: str, run_name: str, tags: dict, dataset: dict | None,
                runs_dir: str | Path, resume: str | None = None,
                system_metrics: bool = True) -> Iterator[TrackedRun]:
    """One MLflow run around the block, ended FINISHED, FAILED or KILLED whatever happens.

    Its folder is `<runs_dir>/<run id>`; runs of this host whose owner is gone are marked KILLED first, and a
    watcher (watcher.py) ends this one KILLED if this process is killed outright. `resume`: an ended run's id."""
    client = prepare_store(uri)
    reap_orphaned_runs(client)
    exp_id = ensure_experiment(client, experiment)
    mlflow.set_system_metrics_sampling_interval(SYSTEM_METRICS_S)
    all_tags = {**{k: str(v) for k, v in tags.items() if v is not None}, **owner_tags()}
    run = mlflow.start_run(run_id=resume, experiment_id=None if resume else exp_id, run_name=run_name,
                           tags=all_tags, log_system_metrics=system_metrics)
    watcher = watch_run(uri, run.info.run_id)
    status, error = "FINISHED", None
    try:
        if dataset:  # a user's script reads its own data
            log_dataset(dataset)
        workdir = RunFolder.of(runs_dir, run.info.run_id).root
        workdir.mkdir(parents=True, exist_ok=True)
        yield TrackedRun(client, run.info.run_id, exp_id, workdir)
    except BaseException as e:
        status, error = status_for(e), describe_stop(e)
        raise
    finally:
        try:
            if status != "FINISHED":
                withdraw_versions(client, run.info.run_id)
        finally:  # a store that refuses the withdrawal must not leave the run RUNNING
            try:
                end_run(client, run.info.run_id, status, error)
            finally:  # this process reached the run's end, whatever the store said: its watcher need not look
                watcher.release()
            checkpoint_wal(uri)  # the store's file alone now shows this run


def attached_run(uri: str, run_id: str, workdir: str | Path) -> TrackedRun:
    """A run another process owns and ends (a placed run's parent), for a node to log into."""
    client = prepare_store(uri)
    run = client.get_run(run_id)
    Path(workdir).mkdir(parents=True, exist_ok=True)
    return TrackedRun(client, run_id, run.info.experiment_id, Path(workdir).resolve())


DUPLICATE_ROW = ("UNIQUE constraint failed", "duplicate key value violates unique constraint")  # SQLite, PostgreSQL


def log_dataset(ds: dict, attempts: int = 5) -> None:
    """The dataset as the active run's input, retried when a concurrent run inserted it first."""
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.meta_dataset import MetaDataset

    source = CodeDatasetSource({"dataset": ds["name"], "root": str(ds.get("root") or "")})
    meta = MetaDataset(source=source, name=ds["name"], digest=ds["sha256"][:36])
    for attempt in range(attempts):
        try:
            return mlflow.log_input(meta, context="training", tags={"samples": str(ds["num_samples"])})
        except mlflow.exceptions.MlflowException as e:  # MLflow's SQL store looks the row up, then inserts it
            if not any(m in str(e) for m in DUPLICATE_ROW) or attempt == attempts - 1:
                raise
            time.sleep(0.05 * (attempt + 1))
