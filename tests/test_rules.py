"""The rules that have one home each (issue #34): run naming, which way a metric is better, the
batch split, the torchrun environment reader, the other projects' workarounds (training/compat.py),
and the one job function's callers. Pure: part of `make test-fast`."""

from __future__ import annotations

import ast
import json
import time
from datetime import timedelta

import pytest

from gpuflow.training.config import batch_split
from gpuflow.training.contract import ranks
from gpuflow.training.judged import better, mode_of, monitored
from tests.helpers import ROOT


@pytest.mark.parametrize("values, stem", [
    ({}, "mlp-digits"),
    ({"model": "myproj.nets:Net", "dataset": "imagefolder:/data/pets"}, "Net-pets"),
    ({"model": "torchvision.models:resnet18", "dataset": "myproj.data:datasets"}, "resnet18-datasets"),
    ({"script": "/home/me/train_ddp.py", "model": "ignored"}, "train_ddp"),
])
def test_one_rule_names_runs_flow_runs_and_studies(values, stem):
    from gpuflow.flows.launchers import stem as run_stem
    from gpuflow.flows.study import study_name

    assert run_stem(values) == stem
    assert study_name(values) == f"sweep-{stem}" and study_name({**values, "study": "s"}) == "s"


@pytest.mark.parametrize("metric, monitor, mode, want", [
    ("val_accuracy", "accuracy", "max", "max"), ("val_loss", "accuracy", "max", "min"),
    ("train_loss", "accuracy", "max", "min"), ("val_mae", "mae", "min", "min"),
    ("val_f1", "mae", "min", "min"), ("val_top5_accuracy", "mae", "min", "max"),
    ("accuracy", "accuracy", "max", "max"), ("val_loss", "", "max", "min"), ("val_bleu", "", "max", "max"),
])
def test_which_way_a_metric_is_better_has_one_rule(metric, monitor, mode, want):
    assert mode_of(metric, monitor, mode) == want


def test_better_is_strict_and_anything_beats_no_champion():
    assert better(0.5, None, "max") and better(0.5, None, "min")
    assert better(0.6, 0.5, "max") and not better(0.5, 0.5, "max") and not better(0.4, 0.5, "max")
    assert better(0.4, 0.5, "min") and not better(0.5, 0.5, "min")


def test_the_built_in_objectives_monitor_without_importing_torch():
    assert monitored("classification") == ("accuracy", "max")
    assert monitored("model-loss") == ("loss", "min")


def test_the_sweep_and_retrain_judge_by_the_same_rule():
    from gpuflow.flows.champion import compared

    evaluation = {"monitor": "mae", "mode": "min", "loss": 0.3, "mae": 0.2, "accuracy": 0.9}
    assert compared("auto", evaluation) == ("mae", "min")
    assert compared("loss", evaluation) == ("loss", "min")
    assert compared("accuracy", evaluation) == ("accuracy", "max")
    with pytest.raises(Exception, match="metric='f1'.*no such metric"):
        compared("f1", evaluation)
    # a sweep that optimized val_loss promotes by loss, not by the objective's monitor (it did by accuracy)
    classified = {"monitor": "accuracy", "mode": "max", "loss": 0.3, "accuracy": 0.9}
    assert compared("auto", classified, "val_loss") == ("loss", "min")
    assert compared("auto", classified, "train_loss") == ("accuracy", "max")  # not held-out: the monitor
    assert compared("accuracy", classified, "val_loss") == ("accuracy", "max")  # asked for: as asked


@pytest.mark.parametrize("batch, devices, processes, fits", [
    (8, 2, 2, True), (1, 2, None, False), (9, 2, 2, False), (9, 2, None, True), (64, 8, 4, True)])
def test_one_batch_split_rule(batch, devices, processes, fits):
    why = batch_split(batch, devices, "devices", processes)
    assert (why is None) == fits
    if not fits:
        assert str(batch) in why and ("smaller than" in why or "split evenly" in why)


def test_torchruns_environment_has_one_reader(monkeypatch):
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(k, raising=False)
    here = ranks()
    assert (here.rank, here.local_rank, here.world_size, here.restarts, here.under_torchrun) == (0, 0, 1, 0, False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    here = ranks()
    assert (here.rank, here.local_rank, here.world_size, here.restarts, here.under_torchrun, here.is_main) == \
        (3, 1, 4, 2, True, False)
    production = [f for p in ("flows", "tasks", "training") for f in (ROOT / p).rglob("*.py")]
    raw = [str(f.relative_to(ROOT)) for f in production if f.name != "contract.py"
           and any(f'"{k}"' in f.read_text() for k in ("RANK", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT"))]
    assert raw == [], f"torchrun's variables read outside training/contract.py ranks(): {raw}"


def test_each_workaround_is_still_needed_on_the_torch_it_was_checked_with():
    """Fails on a newer torch than training/compat.py was checked with: look again at pytorch#167288
    (is TORCH_DISABLE_SHARE_RDZV_TCP_STORE still needed? the per-attempt prefix?) and at c10d's module
    defaults, then raise CHECKED_WITH_TORCH or delete the workaround."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from gpuflow.training import compat

    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    assert version <= compat.CHECKED_WITH_TORCH, f"torch {torch.__version__}: check training/compat.py again"
    store = dist.HashStore()
    compat.attempt_store(store, 2).set("k", "v")
    assert store.get("gpuflow/attempt-2/k") == b"v"
    before = (c10d.default_pg_timeout, c10d.default_pg_nccl_timeout)
    try:
        compat.set_default_pg_timeout(7)
        assert c10d.default_pg_timeout == c10d.default_pg_nccl_timeout == timedelta(seconds=7)
    finally:
        c10d.default_pg_timeout, c10d.default_pg_nccl_timeout = before


def callers(names: set[str]) -> dict[str, set[str]]:
    """Which production modules call each of `names` (as a plain or attribute call)."""
    found: dict[str, set[str]] = {n: set() for n in names}
    for p in ("flows", "tasks", "training"):
        for f in (ROOT / p).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Call):
                    fn = node.func
                    name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
                    if name in names:
                        found[name].add(str(f.relative_to(ROOT)))
    return found


def test_the_operators_policy_is_applied_at_one_door():
    """Every job's parameters meet the allowlist in flows/calls.py `admit` alone (a flow's entry, the CLI, a
    sweep's trial); the other policy checks are of what a run reads back (a published storage URL, a checkpoint)."""
    found = callers({"check_allowed", "check_params", "check_references", "admit", "refusal"})
    assert found["check_allowed"] == found["check_references"] == found["refusal"] == {"flows/calls.py"}
    assert found["check_params"] == {"flows/allow.py"}
    assert found["admit"] == {"flows/calls.py", "flows/cli.py", "flows/trial.py"}


def test_every_training_job_goes_through_the_one_job_function():
    """A run, a script, a sweep's trial and a node: the MLflow run is opened by flows/job.py alone,
    the worker and scripts are launched by the launchers alone, models registered by them and the sweep's
    best (flows/sweep.py, through the launcher's and the results' one register)."""
    found = callers({"tracked_run", "launch_training", "launch_script", "register_model", "training_session"})
    assert found["tracked_run"] == {"flows/job.py"}
    assert found["training_session"] == {"flows/job.py"}
    assert found["launch_training"] | found["launch_script"] == {"flows/launchers.py"}
    assert found["register_model"] <= {"flows/launchers.py", "tasks/tracking/results.py", "flows/sweep.py"}
    assert callers({"run_job"})["run_job"] == {"flows/train.py", "flows/script.py", "flows/trial.py", "flows/nodes.py"}


def test_progress_in_the_working_folder_is_a_checkpoint_file_not_the_tracking_store(tmp_path):
    from gpuflow.training.contract import made_progress

    since = time.time() - 1
    (tmp_path / "mlflow.db").write_text("written by the flow while the script ran")
    (tmp_path / "out").mkdir()
    assert not made_progress(since, tmp_path / "out", top_level=tmp_path)  # a failure then is not retried
    (tmp_path / "snapshot.pt").write_bytes(b"weights")
    assert made_progress(since, tmp_path / "out", top_level=tmp_path)
    assert not made_progress(time.time() + 1, tmp_path / "out", top_level=tmp_path)


@pytest.mark.parametrize("finished, local, replayed", [(2, 2, True), (1, 2, False), (2, 1, False)])
def test_a_restart_replays_success_only_when_every_rank_of_one_machine_finished(
        tmp_path, monkeypatch, finished, local, replayed):
    from gpuflow.training.contract import ERROR_DIR_ENV, replay_finished

    (tmp_path / "attempt-0").mkdir()
    for r in range(finished):
        (tmp_path / "attempt-0" / f"finished-{r}").touch()
    for k, v in {ERROR_DIR_ENV: str(tmp_path), "RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": str(local),
                 "TORCHELASTIC_RESTART_COUNT": "1"}.items():
        monkeypatch.setenv(k, v)
    assert replay_finished() is replayed
    assert (tmp_path / "attempt-1" / "finished-1").exists() is replayed  # so a later restart replays it too


def test_the_flow_judges_a_failed_job_by_its_last_attempt_not_an_earlier_one(tmp_path):
    """A rank killed on purpose in attempt 0 left an error; attempt 1 ran to its end on both ranks, then one
    died at exit: that error is not the cause, and the job's script did finish (the run stands)."""
    from gpuflow.training.contract import ran_to_the_end, read_error

    assert read_error(tmp_path) is None and not ran_to_the_end(tmp_path, 2)
    (tmp_path / "attempt-0").mkdir()
    (tmp_path / "attempt-0" / "rank-0.json").write_text(json.dumps(
        {"type": "RuntimeError", "message": "Connection reset by peer", "rank": 0, "time": 1.0,
         "deterministic": False}))
    assert read_error(tmp_path)["message"] == "Connection reset by peer" and not ran_to_the_end(tmp_path, 2)
    (tmp_path / "attempt-1").mkdir()  # its ranks started (start_attempt), then were killed by a signal
    assert read_error(tmp_path) is None and not ran_to_the_end(tmp_path, 2)  # the cause: the signal, not attempt 0
    (tmp_path / "attempt-1" / "finished-0").touch()
    assert read_error(tmp_path) is None and not ran_to_the_end(tmp_path, 2)  # rank 1 never finished
    (tmp_path / "attempt-1" / "finished-1").touch()
    assert ran_to_the_end(tmp_path, 2) and not ran_to_the_end(tmp_path, 3)
