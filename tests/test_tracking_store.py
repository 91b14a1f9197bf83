"""The flow's MLflow run on a real SQLite store, without Prefect: one context manager that always
ends the run, the metrics relay, runs left RUNNING by a dead owner, runs started together."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import types

import mlflow
import psutil
import pytest

from gpuflow.tasks.tracking import orphans, results, store, tracked
from gpuflow.training.metrics import MetricsFile

DATASET = {"name": "synthetic", "root": None, "sha256": "ab" * 32, "num_samples": 10}


def _uri(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def _runs(uri: str, experiment: str) -> list:
    return mlflow.MlflowClient(uri).search_runs(
        [mlflow.MlflowClient(uri).get_experiment_by_name(experiment).experiment_id])


def test_tracked_run_ends_finished_failed_or_killed_with_the_reason(tmp_path):
    uri = _uri(tmp_path)
    with tracked.tracked_run(uri, "ends", "ok", {}, DATASET, tmp_path / "runs", system_metrics=False) as ok:
        assert ok.workdir == (tmp_path / "runs" / ok.run_id).resolve() and ok.workdir.is_dir()
    with pytest.raises(ValueError):
        with tracked.tracked_run(uri, "ends", "bad", {}, DATASET, tmp_path / "runs", system_metrics=False):
            raise ValueError("boom in training")
    with pytest.raises(KeyboardInterrupt):
        with tracked.tracked_run(uri, "ends", "stopped", {}, DATASET, tmp_path / "runs", system_metrics=False):
            raise KeyboardInterrupt
    by_name = {r.info.run_name: r for r in _runs(uri, "ends")}
    assert {n: r.info.status for n, r in by_name.items()} == {"ok": "FINISHED", "bad": "FAILED", "stopped": "KILLED"}
    assert by_name["bad"].data.tags["error"] == "ValueError: boom in training"
    assert by_name["stopped"].data.tags["error"] == "stopped by Ctrl-C (SIGINT) to the flow"
    assert mlflow.active_run() is None


def test_a_run_whose_start_fails_is_marked_failed_not_left_running(tmp_path):
    uri = _uri(tmp_path)
    with pytest.raises(KeyError):
        with tracked.tracked_run(uri, "half", "bad", {}, {"name": "no digest"}, tmp_path / "runs",
                                 system_metrics=False):
            pass
    assert mlflow.active_run() is None
    assert [r.info.status for r in _runs(uri, "half")] == ["FAILED"]


def test_a_run_is_ended_even_when_its_error_tag_cannot_be_written(tmp_path, monkeypatch):
    """Left RUNNING and active, it would end FINISHED at exit and block the next run on the thread; and the
    training's error is what is raised."""
    uri, set_tag = _uri(tmp_path), mlflow.MlflowClient.set_tag

    def failing(self, run_id, key, value, *a, **kw):
        if key == "error":
            raise ConnectionError("the store went away")
        return set_tag(self, run_id, key, value, *a, **kw)

    monkeypatch.setattr(mlflow.MlflowClient, "set_tag", failing)
    with pytest.raises(ValueError, match="boom in training"):
        with tracked.tracked_run(uri, "tagless", "bad", {}, DATASET, tmp_path / "runs", system_metrics=False):
            raise ValueError("boom in training")
    assert mlflow.active_run() is None
    assert [r.info.status for r in _runs(uri, "tagless")] == ["FAILED"]


def test_relay_logs_complete_lines_live_and_the_rest_when_it_stops(tmp_path):
    uri = _uri(tmp_path)
    with tracked.tracked_run(uri, "relay", "r", {}, DATASET, tmp_path / "runs", system_metrics=False) as run:
        client = run.client
        sink = MetricsFile(is_main=True, path=str(run.metrics_file))
        assert MetricsFile(is_main=False, path=str(run.metrics_file))._file is None  # rank 0 only
        with run.relaying_metrics() as relay:
            sink.log_epoch(1, {"val_accuracy": 0.1, "train_loss": 1.0})
            deadline = time.monotonic() + 30
            while not client.get_metric_history(run.run_id, "val_accuracy") and time.monotonic() < deadline:
                time.sleep(0.1)
            assert len(client.get_metric_history(run.run_id, "val_accuracy")) == 1  # live, before the end
            for epoch in (2, 3):
                sink.log_epoch(epoch, {"val_accuracy": epoch / 10, "train_loss": 1.0 / epoch})
            with open(run.metrics_file, "a") as f:
                f.write('{"step": 4, "timestamp": 1, "metr')  # a writer killed mid-line
        sink.close()
        assert relay.logged == 3
    history = client.get_metric_history(run.run_id, "val_accuracy")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.1), (2, 0.2), (3, 0.3)]


OWNER = """
import sys, time
from gpuflow.tasks.tracking import orphans, store, tracked
with tracked.tracked_run(sys.argv[1], "orphans", "victim", {}, {"name": "d", "sha256": "ab" * 32,
                          "num_samples": 1}, sys.argv[2], system_metrics=False) as run:
    print(run.run_id, flush=True)
    time.sleep(600)
"""


def test_a_run_whose_owner_was_killed_outright_is_marked_killed_by_the_next_start(tmp_path):
    uri = _uri(tmp_path)
    owner = subprocess.Popen([sys.executable, "-c", OWNER, uri, str(tmp_path / "runs")],
                             stdout=subprocess.PIPE, text=True)
    victim = owner.stdout.readline().strip()
    client = mlflow.MlflowClient(uri)
    assert client.get_run(victim).info.status == "RUNNING"
    assert orphans.reap_orphaned_runs(client) == []  # its owner is alive: left alone
    (watcher,) = psutil.Process(owner.pid).children()
    watcher.kill()  # first, as a host crash would: it runs no more code (tests/test_killed_flow.py: its own part)
    owner.send_signal(signal.SIGKILL)  # no finally, no exit handler runs
    owner.wait()
    assert client.get_run(victim).info.status == "RUNNING"
    with tracked.tracked_run(uri, "orphans", "next", {}, DATASET, tmp_path / "runs", system_metrics=False):
        pass
    run = client.get_run(victim)
    assert run.info.status == "KILLED"
    assert f"pid {owner.pid}" in run.data.tags["error"] and "killed or crashed" in run.data.tags["error"]


def test_a_reused_pid_does_not_keep_a_dead_owners_run_alive(tmp_path):
    uri = _uri(tmp_path)
    client = store.prepare_store(uri)
    exp = client.create_experiment("reuse")
    # This very process, but started at another time: the pid was reused.
    tags = {**orphans.owner_tags(), orphans.OWNER_STARTED: "1000.000"}
    stale = client.create_run(exp, tags=tags).info.run_id
    live = client.create_run(exp, tags=orphans.owner_tags()).info.run_id
    other_host = client.create_run(exp, tags={**tags, orphans.OWNER_HOST: "some-other-host"}).info.run_id
    assert orphans.reap_orphaned_runs(client) == [stale]
    assert [client.get_run(r).info.status for r in (stale, live, other_host)] == ["KILLED", "RUNNING", "RUNNING"]


def test_prefect_crash_hook_ends_the_flow_runs_mlflow_run_killed(tmp_path):
    # The hook Prefect's runner calls, in its own process, when a served flow run crashes
    # or is cancelled: flow_run carries the id the run is tagged with and the parameters.
    uri = _uri(tmp_path)
    client = store.prepare_store(uri)
    exp = client.create_experiment("hook")
    mine = client.create_run(exp, tags={store.FLOW_RUN_TAG: "flow-run-1"}).info.run_id
    other = client.create_run(exp, tags={store.FLOW_RUN_TAG: "flow-run-2"}).info.run_id
    flow_run = types.SimpleNamespace(id="flow-run-1", name="mlp-digits", parameters={"tracking_uri": uri})
    state = types.SimpleNamespace(name="Crashed", message="Flow run process exited with code -9")
    orphans.end_flow_run_mlflow_runs(None, flow_run, state)
    assert client.get_run(mine).info.status == "KILLED"
    assert "ended Crashed: Flow run process exited with code -9" in client.get_run(mine).data.tags["error"]
    assert client.get_run(other).info.status == "RUNNING"


def start_together(uri: str, experiment: str, runs_dir: Path, n: int = 6) -> list[Exception]:
    """n tracked runs started at once, each logging the same dataset; the errors they raised."""
    errors, barrier = [], threading.Barrier(n)

    def one(i):
        barrier.wait()
        try:
            with tracked.tracked_run(uri, experiment, f"r{i}", {"i": i}, DATASET, runs_dir, system_metrics=False):
                pass
        except Exception as e:  # noqa: BLE001 - collected and asserted by the caller
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return errors


def assert_linked_once(runs: list, n: int) -> None:
    assert len(runs) == n and {r.info.status for r in runs} == {"FINISHED"}
    for r in runs:
        inputs = r.inputs.dataset_inputs
        assert [(d.dataset.name, d.dataset.digest) for d in inputs] == [("synthetic", DATASET["sha256"][:36])]


@pytest.mark.parametrize("trial", range(2))
def test_runs_started_together_all_link_the_same_dataset(tmp_path, trial):
    # MLflow's SQL store checks for the dataset row, then inserts it: without the retry in
    # tracked.log_dataset one of these starts fails the UNIQUE constraint (seen in CI).
    uri = _uri(tmp_path)
    store.prepare_store(uri)
    errors = start_together(uri, "race", tmp_path / "runs")
    assert not errors, errors
    assert_linked_once(_runs(uri, "race"), 6)


PREPARE_AT = """
import sys, time
import mlflow  # imported before the start time: the creations overlap as closely as possible
from gpuflow.tasks.tracking.store import prepare_store
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
prepare_store(sys.argv[1])
"""


@pytest.mark.parametrize("trial", range(2))
def test_processes_creating_a_new_store_together_all_succeed(tmp_path, trial):
    # Flows started at once on a fresh mlflow.db each create its tables; without the lock in
    # store.prepare_store they collide ('table ... already exists', seen in CI).
    uri = f"sqlite:///{tmp_path / 'sub' / 'mlflow.db'}"
    at = str(time.time() + 8)
    procs = [subprocess.Popen([sys.executable, "-c", PREPARE_AT, uri, at], stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    errs = [p.communicate(timeout=180)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(e[-1500:] for e in errs)
    client = mlflow.MlflowClient(tracking_uri=uri)
    assert client.search_experiments()[0].name == "Default"


REGISTERING = """
import sys, time
from pathlib import Path
import mlflow
from gpuflow.tasks.tracking import results, tracked
from gpuflow.training.lifetime import exit_on_sigterm


def saving(path, **kw):  # the slow step of registration, where the signal lands
    print("registering", flush=True)
    time.sleep(600)

exit_on_sigterm()  # as the CLI does
mlflow.pyfunc.save_model = saving
weights = Path(sys.argv[2]) / "weights.pt"
weights.parent.mkdir(parents=True, exist_ok=True)
weights.write_bytes(b"")
with tracked.tracked_run(sys.argv[1], "register", "r", {}, None, sys.argv[2], system_metrics=False) as run:
    results.register_model(run, {"model_spec": {"reference": "gpuflow.training.models:MLP", "kwargs": {}},
                                 "weights": str(weights)}, "m", None, "a test")
"""


def test_a_sigterm_during_registration_ends_the_logged_model_failed_and_the_run_killed(tmp_path):
    uri = _uri(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", REGISTERING, uri, str(tmp_path / "runs")],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "registering"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 143
    finally:
        proc.kill()
        proc.wait()
    client = mlflow.MlflowClient(uri)
    [run] = _runs(uri, "register")
    models = client.search_logged_models([run.info.experiment_id])
    assert [m.status.name for m in models] == ["FAILED"]
    assert run.info.status == "KILLED"
    assert client.search_registered_models() == []


def test_registering_reads_no_packages_metadata_once_warmed_while_training(tmp_path, monkeypatch):
    """MLflow's requirement check maps every installed distribution once per process; warm_model_logging builds
    that map in the background as training starts, so registering does not wait for it. Fails when MLflow stops
    keeping the map (then the warm-up has nothing to do and can go)."""
    import importlib_metadata
    from mlflow.utils import requirements_utils

    if results._warming is not None:  # an earlier test's warm-up must not rebuild the map after the reset
        results._warming.join(60)
    monkeypatch.setattr(requirements_utils, "_MODULES_TO_PACKAGES", None)  # as in a fresh process
    monkeypatch.setattr(results, "_warming", None)
    mapped_by, real = [], importlib_metadata.packages_distributions
    monkeypatch.setattr(importlib_metadata, "packages_distributions",
                        lambda: mapped_by.append(threading.current_thread().name) or real())
    results.warm_model_logging()
    weights = tmp_path / "weights.pt"
    weights.write_bytes(b"")
    with tracked.tracked_run(_uri(tmp_path), "warm", "r", {}, None, str(tmp_path / "runs"),
                             system_metrics=False) as run:
        version = results.register_model(run, {"model_spec": {"reference": "gpuflow.training.models:MLP",
                                                              "kwargs": {}}, "weights": str(weights)},
                                         "m", None, "a test")
    assert version == "1"
    assert mapped_by == ["gpuflow-warm-model-logging"]


def _copy_alone(db, dest):
    """The store's file copied without its -wal and -shm, as a backup or a colleague gets it."""
    import shutil

    dest.mkdir()
    shutil.copyfile(db, dest / "mlflow.db")
    return f"sqlite:///{dest / 'mlflow.db'}"


def test_the_store_file_alone_shows_a_run_once_it_ends(tmp_path):
    uri = _uri(tmp_path)
    with tracked.tracked_run(uri, "wal", "ended", {}, DATASET, tmp_path / "runs", system_metrics=False) as run:
        run.log_metrics({"accuracy": 0.5})
    copy = _copy_alone(tmp_path / "mlflow.db", tmp_path / "copy")
    [found] = _runs(copy, "wal")
    assert (found.info.run_id, found.info.status, found.data.metrics) == (run.run_id, "FINISHED", {"accuracy": 0.5})


def test_checkpointing_the_log_is_harmless_for_other_stores_and_while_a_writer_holds_it(tmp_path):
    import sqlite3

    assert store.checkpoint_wal("postgresql://nowhere/db") is False
    assert store.checkpoint_wal(_uri(tmp_path / "absent")) is False and not (tmp_path / "absent").exists()
    uri = _uri(tmp_path)
    store.prepare_store(uri)
    writer = sqlite3.connect(tmp_path / "mlflow.db")
    try:
        writer.execute("BEGIN EXCLUSIVE")  # another process mid-write
        assert store.checkpoint_wal(uri, busy_timeout_s=0.1) is False
    finally:
        writer.rollback()
        writer.close()
    assert store.checkpoint_wal(uri) is True
