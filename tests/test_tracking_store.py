"""The MLflow side of the flow on a real SQLite store, without Prefect: runs started
together on one store, and a run whose start fails half-way."""

from __future__ import annotations

import threading
import types

import mlflow
import pytest

from tasks.track import prepare_store, start_run

DATASET = types.SimpleNamespace(name="synthetic", root=None, sha256="ab" * 32, num_samples=10)


@pytest.mark.parametrize("trial", range(3))
def test_runs_started_together_all_link_the_same_dataset(tmp_path, trial):
    # MLflow's SQL store checks for the dataset row, then inserts it: without the retry in
    # tasks.track.log_dataset one of these starts fails the UNIQUE constraint (seen in CI)
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
