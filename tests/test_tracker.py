"""The flow's MLflow tracker process (tasks/tracker.py) on a real SQLite store: it starts,
logs and ends the flow's run, reports errors back, and never leaves a run RUNNING when the
flow process dies or the tracker itself does."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import mlflow
import pytest

from flows.cli import wants_tracker
from tasks import tracker as tracker_mod
from tasks.tracker import Tracker, TrackerError, TrackerGone

DATASET = {"name": "synthetic", "root": None, "sha256": "cd" * 32, "num_samples": 10}


def start(t: Tracker, uri: str, params: dict | None = None, experiment: str = "tracked") -> dict:
    return t.call("start", uri=uri, experiment=experiment, run_name="r", params=params or {"lr": 0.1},
                  tags={"strategy": "ddp", "none": None}, dataset=DATASET,
                  artifacts=[{"obj": {"gpus": []}, "name": "environment_report.json"}],
                  system_metrics_interval=60)


def wait_status(uri: str, run_id: str, want: str, timeout: float = 60) -> mlflow.entities.Run:
    client = mlflow.MlflowClient(tracking_uri=uri)
    deadline = time.monotonic() + timeout
    while True:
        run = client.get_run(run_id)
        if run.info.status == want or time.monotonic() > deadline:
            return run
        time.sleep(0.2)


def test_tracker_starts_logs_and_ends_the_flows_run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    t = Tracker()
    try:
        started = start(t, uri)
        t.call("log_metrics", run_id=started["run_id"], metrics={"pipeline.launch_s": 1.5})
        assert t.call("end", run_id=started["run_id"], status="FINISHED") == "FINISHED"
    finally:
        t.close()
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.get_run(started["run_id"])
    assert run.info.status == "FINISHED" and run.info.experiment_id == started["experiment_id"]
    assert run.data.params["lr"] == "0.1" and run.data.tags["strategy"] == "ddp"
    assert "none" not in run.data.tags
    assert run.data.metrics["pipeline.launch_s"] == 1.5
    assert [a.path for a in client.list_artifacts(run.info.run_id, "environment")] == [
        "environment/environment_report.json"]
    assert [d.dataset.digest for d in run.inputs.dataset_inputs] == [DATASET["sha256"][:36]]


def test_tracker_errors_come_back_with_the_original_message_and_the_run_failed(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    t = Tracker()
    try:
        with pytest.raises(TrackerError, match="MlflowException"):
            start(t, uri, params={"what?": 1}, experiment="half")  # a name MLflow refuses
        with pytest.raises(TrackerError, match="unknown tracker operation 'nope'"):
            t.call("nope")
        assert t.alive()  # errors do not end the tracker
    finally:
        t.close()
    client = mlflow.MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("half").experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]
    assert "MlflowException" in runs[0].data.tags["error"]


FLOW_THAT_DIES = textwrap.dedent("""
    import json, os, sys
    from tasks.tracker import Tracker
    t = Tracker()
    out = t.call("start", uri=sys.argv[1], experiment="dies", run_name="r", params={}, tags={},
                 dataset={"name": "d", "sha256": "ab" * 32, "num_samples": 1}, artifacts=[],
                 system_metrics_interval=60)
    print(json.dumps(out), flush=True)
    os.kill(os.getpid(), 9)  # the flow process is killed: no finally, no atexit
""")


def test_a_killed_flow_process_leaves_its_run_killed_not_running(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    p = subprocess.run([sys.executable, "-c", FLOW_THAT_DIES, uri], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == -9, p.stderr[-2000:]
    run_id = json.loads(p.stdout.strip().splitlines()[-1])["run_id"]
    run = wait_status(uri, run_id, "KILLED")
    assert run.info.status == "KILLED", run.info
    assert "flow process ended" in run.data.tags["error"]


def test_the_flow_ends_the_run_itself_when_its_tracker_is_gone(tmp_path):
    from flows.train import end_run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    t = Tracker()
    run_id = start(t, uri)["run_id"]
    t._proc.kill()  # the tracker dies (OOM killer, say): it cannot end the run
    t._proc.wait()
    with pytest.raises(TrackerGone):
        t.call("end", run_id=run_id, status="FINISHED")
    end_run(t, uri, run_id, RuntimeError("worker failed"))
    run = mlflow.MlflowClient(tracking_uri=uri).get_run(run_id)
    assert run.info.status == "FAILED" and run.data.tags["error"] == "RuntimeError: worker failed"
    t.close()


def test_acquire_takes_the_early_tracker_while_it_lives(monkeypatch):
    monkeypatch.setattr(tracker_mod, "_spare", [])
    tracker_mod.prestart()
    early = tracker_mod._spare[0]
    assert tracker_mod.acquire() is early and not tracker_mod._spare
    early.close()
    tracker_mod.prestart()
    dead = tracker_mod._spare[0]
    dead.kill()
    fresh = tracker_mod.acquire()
    try:
        assert fresh is not dead and fresh.alive()
    finally:
        fresh.close()


@pytest.mark.parametrize("argv, want", [
    (["run"], True), (["run", "--epochs", "2"], True), (["run", "--node-rank", "0"], True),
    (["run", "--node-rank=1"], False), (["run", "--node-rank", "2"], False),
    (["run", "--help"], False), (["probe"], False), ([], False)])
def test_the_cli_starts_a_tracker_only_for_runs_that_will_own_an_mlflow_run(argv, want):
    assert wants_tracker(argv) is want


def test_tracker_relays_rank0_metrics_file_to_the_run_live_and_completely(tmp_path, monkeypatch):
    from training.tracking import METRICS_FILE_ENV, MetricsSink

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    path = tmp_path / "metrics.jsonl"
    client = mlflow.MlflowClient(tracking_uri=uri)
    t = Tracker()
    try:
        run_id = start(t, uri)["run_id"]
        t.call("follow", run_id=run_id, path=str(path))
        monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
        monkeypatch.setenv(METRICS_FILE_ENV, str(path))
        sink = MetricsSink(is_main=True)  # rank 0 under the flow: a file, no logger process
        assert sink._proc is None
        for epoch in (1, 2):
            sink.log_epoch(epoch, {"val_accuracy": epoch / 10})
        deadline = time.monotonic() + 30  # live: logged while the run is still open
        while len(client.get_metric_history(run_id, "val_accuracy")) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(client.get_metric_history(run_id, "val_accuracy")) == 2
        sink.log_epoch(3, {"val_accuracy": 0.3})
        sink.close()
        with open(path, "a") as f:
            f.write('{"step": 4, "timestamp": 0, "metr')  # a line cut short by a crash
        t.call("end", run_id=run_id, status="FINISHED")  # logs what is complete, then ends
    finally:
        t.close()
    hist = client.get_metric_history(run_id, "val_accuracy")
    assert sorted((m.step, m.value) for m in hist) == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert client.get_run(run_id).info.status == "FINISHED"
