"""The MLflow side of the flow on a real SQLite store, without Prefect: runs started
together on one store, and a run whose start fails half-way."""

from __future__ import annotations

import threading
import types

import mlflow
import pytest

from gpuflow.tasks.mlrun import prepare_store, start_run

DATASET = types.SimpleNamespace(name="synthetic", root=None, sha256="ab" * 32, num_samples=10)


@pytest.mark.parametrize("trial", range(3))
def test_runs_started_together_all_link_the_same_dataset(tmp_path, trial):
    # MLflow's SQL store checks for the dataset row, then inserts it: without the retry in
    # tasks.mlrun.log_dataset one of these starts fails the UNIQUE constraint (seen in CI)
    # and its run stays RUNNING.
    prepare_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    n, errors = 6, []
    barrier = threading.Barrier(n)

    def one(i):
        barrier.wait()
        try:
            start_run("race", f"r{i}", {"i": i}, {}, DATASET, system_metrics_interval=60)
            mlflow.end_run()
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    runs = mlflow.search_runs(experiment_names=["race"], output_format="list")
    assert len(runs) == n and {r.info.status for r in runs} == {"FINISHED"}
    for r in runs:
        inputs = r.inputs.dataset_inputs
        assert [(d.dataset.name, d.dataset.digest) for d in inputs] == [("synthetic", DATASET.sha256[:36])]


def test_a_run_whose_start_fails_is_marked_failed_not_left_running(tmp_path):
    prepare_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    with pytest.raises(mlflow.exceptions.MlflowException):
        # a parameter name MLflow refuses makes log_params fail after the run exists
        start_run("half", "bad", {"what?": 1}, {}, DATASET, system_metrics_interval=60)
    assert mlflow.active_run() is None
    runs = mlflow.search_runs(experiment_names=["half"], output_format="list")
    assert [r.info.status for r in runs] == ["FAILED"]
    assert "MlflowException" in runs[0].data.tags["error"]


def test_rank0_logger_process_writes_every_epoch_before_close_returns(tmp_path, monkeypatch):
    # training.tracking.MetricsSink hands metrics to training/metrics_logger.py, a child
    # process; close() must not return before the last epoch is in the store, since the flow
    # reads and ends the run right after the workers exit.
    from gpuflow.training.tracking import MetricsSink

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    prepare_store(uri)
    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("sink")).info.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    assert MetricsSink(is_main=False)._proc is None  # other ranks never start one
    sink = MetricsSink(is_main=True)
    sink.wait_ready()
    for epoch in (1, 2, 3):
        sink.log_epoch(epoch, {"val_accuracy": epoch / 10, "train_loss": 1.0 / epoch})
    sink.close()
    history = client.get_metric_history(run_id, "val_accuracy")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert len(client.get_metric_history(run_id, "train_loss")) == 3
    sink.log_epoch(4, {"val_accuracy": 0.4})  # after close: ignored, no error
    assert client.get_run(run_id).info.status == "RUNNING"  # the logger never ends the run


PREPARE_AT = """
import sys, time
import mlflow  # imported before the start time: the creations overlap as closely as possible
from gpuflow.tasks.mlrun import prepare_store
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
prepare_store(sys.argv[1])
"""


@pytest.mark.parametrize("trial", range(2))
def test_processes_creating_a_new_store_together_all_succeed(tmp_path, trial):
    # Three flows started at once on a fresh mlflow.db each create its tables; without the
    # lock in tasks.mlrun.prepare_store they collide ('table ... already exists', seen in CI).
    import subprocess
    import sys
    import time

    uri = f"sqlite:///{tmp_path / 'sub' / 'mlflow.db'}"
    at = str(time.time() + 8)
    procs = [subprocess.Popen([sys.executable, "-c", PREPARE_AT, uri, at], stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    errs = [p.communicate(timeout=180)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(e[-1500:] for e in errs)
    client = mlflow.MlflowClient(tracking_uri=uri)
    assert client.search_experiments()[0].name == "Default"
