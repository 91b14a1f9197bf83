"""Sweeps (flows/sweep.py): Optuna trials as runs of the training session, on CPU slots here.

Real parts throughout: the sweep flow on the session's Prefect server, real torchrun trials
(gloo), a real SQLite MLflow store and a real SQLite Optuna study.
"""

import json
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import mlflow
import optuna
import pytest
from optuna.trial import TrialState

from gpuflow.flows.cli import main
from gpuflow.flows.space import SweepError
from gpuflow.tasks.devices.cards import CardLocks

from .helpers import BIN, child_env

SPACE = "lr: {type: float, low: 1.0e-3, high: 0.1, log: true}\noptimizer: {type: choice, values: [adam, sgd]}\n"
FAST = dict(epochs=2, batch_size=64, dataset="digits", model="mlp")


def _space(tmp_path: Path, text: str = SPACE) -> str:
    (tmp_path / "space.yaml").write_text(text)
    return str(tmp_path / "space.yaml")


def _runs(uri: str) -> tuple[list, list]:
    """(the sweep's parent runs, its trials' runs)."""
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    return ([r for r in runs if "mlflow.parentRunId" not in r.data.tags],
            [r for r in runs if "mlflow.parentRunId" in r.data.tags])


def _most_at_once(runs) -> int:
    edges = sorted([(r.info.start_time, 1) for r in runs] + [(r.info.end_time, -1) for r in runs])
    now = most = 0
    for _, d in edges:
        now += d
        most = max(most, now)
    return most


def _study(tmp_path: Path, name: str):
    return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / 'optuna.db'}")


@pytest.mark.parametrize("space, args, says", [
    ("lrr: {type: float, low: 0.1, high: 1}", [], "'lrr' is not a parameter a trial can set"),
    ("gpus: {type: choice, values: ['0,', '1,']}", [], "gpuflow sets the devices"),
    ("lr: {type: float, low: 0.1, high: 0.01}", [], "[0.1, 0.01] is empty or inverted"),
    ("lr: {type: float, low: 0.0, high: 0.1, log: true}", [], "needs low > 0"),
    ("epochs: {type: float, low: 1, high: 4}", [], "epochs takes whole numbers"),
    ("batch_size: {type: int, low: 0, high: 64}", [], "batch_size=0 is not a value a run accepts"),
    ("optimizer: {type: choice, values: []}", [], "non-empty `values`"),
    ("model_args.width: {type: int, low: 8, high: 64}", [], "the built-in 'mlp' takes none"),
    (SPACE, ["--optimize", "val_f1"], "optimize='val_f1': objective 'classification' reports no such metric"),
    (SPACE, ["--gpus", "0,1", "--parallel", "3"], "parallel=3 trials x gpus_per_trial=1 need 3 cards"),
    (SPACE, ["--nodes", "2"], "drop nodes"),
])
def test_bad_sweeps_are_refused_before_anything_starts_naming_the_value(tmp_path, capsys, space, args, says):
    code = main(["sweep", "--space", _space(tmp_path, space), "--tracking-uri",
                 f"sqlite:///{tmp_path / 'mlflow.db'}", *args])
    err = capsys.readouterr().err
    assert code == 2 and says in err, err
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "optuna.db").exists()


def test_six_trials_two_at_a_time_nest_under_one_run_and_the_best_is_registered(prefect_api, tmp_path):
    from gpuflow.flows.sweep import sweep

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = sweep(**FAST, space=_space(tmp_path), trials=6, parallel="2", pruner="none", gpus="cpu",
                study="six", sampler_seed=1, tracking_uri=uri, runs_dir=str(tmp_path / "runs"),
                registered_model="swept")
    (parent,), trials = _runs(uri)
    assert parent.info.run_id == out["run_id"] and parent.info.status == "FINISHED"
    assert len(trials) == 6 and all(r.info.status == "FINISHED" for r in trials)
    assert {r.data.tags["mlflow.parentRunId"] for r in trials} == {parent.info.run_id}
    assert _most_at_once(trials) == 2  # two at a time, never three
    assert {r.data.tags["sweep.slot"] for r in trials} == {"cpu0", "cpu1"}
    # the host is sampled once, in the sweep's run, not by each trial's monitor again
    assert any(k.startswith("system/") for k in parent.data.metrics)
    assert not [k for r in trials for k in r.data.metrics if k.startswith("system/")]
    assert all(r.data.params["world_size"] == "1" for r in trials)  # one CPU slot each
    values = {(r.data.params["lr"], r.data.params["optimizer"]) for r in trials}
    assert len(values) == 6  # every trial its own params
    for r in trials:  # live metrics: one point per epoch; a checkpoint of the last epoch alone (it never resumes)
        assert len(mlflow.MlflowClient().get_metric_history(r.info.run_id, "val_accuracy")) == 2
        kept = (tmp_path / "runs" / r.info.run_id / "checkpoints").glob("epoch-*.pt")
        assert [p.name for p in kept] == ["epoch-0002.pt"] and r.data.params["checkpoint_each_epoch"] == "False"
        plan = json.loads(Path(mlflow.MlflowClient().download_artifacts(
            r.info.run_id, "environment/device_plan.json", str(tmp_path / r.info.run_id))).read_text())
        assert plan["cpu_threads"] == 1  # its slot's one core: two trials never run four threads on two cores
    study = _study(tmp_path, "six")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 6
    assert all(t.intermediate_values == {} for t in study.trials)  # no pruner: per-epoch values stay in the runs
    best = study.best_trial
    assert out["best_value"] == best.value and out["best_params"] == best.params
    best_run = next(r for r in trials if r.info.run_id == best.user_attrs["mlflow_run_id"])
    assert best_run.data.metrics["val_accuracy"] == pytest.approx(best.value)
    assert max(r.data.metrics["val_accuracy"] for r in trials) == pytest.approx(best.value)
    client = mlflow.MlflowClient()
    (version,) = client.search_model_versions("name='swept'")
    assert version.run_id == best_run.info.run_id and out["model_version"] == str(version.version)
    assert client.get_model_version_by_alias("swept", "champion").version == version.version  # first: promoted
    assert parent.data.params["best.trial"] == str(best.number)
    assert parent.data.metrics["best_val_accuracy"] == pytest.approx(best.value)
    arts = {a.path for a in client.list_artifacts(parent.info.run_id, "sweep")}
    assert {"sweep/trials.csv", "sweep/space.json", "sweep/optimization_history.png",
            "sweep/parallel_coordinate.png", "sweep/param_importances.png"} <= arts


def test_the_pruner_stops_a_bad_trial_within_an_epoch_and_tags_it(prefect_api, tmp_path):
    from gpuflow.flows.sweep import sweep

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    study = optuna.create_study(study_name="prune", storage=f"sqlite:///{tmp_path / 'optuna.db'}",
                                direction="maximize")
    for lr in (0.05, 0.05, 1e-6):  # two good trials, then one that cannot learn in time
        study.enqueue_trial({"lr": lr, "optimizer": "sgd"})
    short = FAST | {"epochs": 40, "cpu_processes": 1}  # epochs of well under 100 ms: the output never pauses
    out = sweep(**short, space=_space(tmp_path), trials=3, parallel="1", pruner="median",
                gpus="cpu", study="prune", tracking_uri=uri, runs_dir=str(tmp_path / "runs"),
                registered_model="pruned")
    study = _study(tmp_path, "prune")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.COMPLETE, TrialState.PRUNED]
    _, trials = _runs(uri)
    bad = next(r for r in trials if r.data.tags["sweep.trial"] == "2")
    assert bad.info.status == "FINISHED" and bad.data.tags["sweep.pruned"].startswith("after epoch ")
    history = mlflow.MlflowClient().get_metric_history(bad.info.run_id, "val_accuracy")
    assert 1 <= len(history) < 40  # its last metrics kept, its remaining epochs never run
    pruned_at = int(bad.data.tags["sweep.pruned"].split()[-1])  # the epoch the pruner decided at
    assert pruned_at == min(h.step for h in history)  # a median pruner without warm-up decides at once
    assert len(history) <= pruned_at + 3  # stopped within about an epoch of the decision
    assert out["trials"] == {"complete": 2, "pruned": 1}


def _sweep_cmd(tmp_path: Path, trials: int, *extra: str) -> list[str]:
    return [str(BIN / "gpuflow"), "sweep", "--space", _space(tmp_path), "--trials", str(trials),
            "--epochs", "2", "--dataset", "digits", "--gpus", "cpu", "--study", "s", "--pruner", "none",
            "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "--runs-dir", str(tmp_path / "runs"),
            "--registered-model", "resumed", *extra]


def _env(**extra) -> dict:
    from prefect.settings import PREFECT_API_URL

    return child_env(PREFECT_API_URL=PREFECT_API_URL.value(), **extra)


def _states(tmp_path: Path) -> list[TrialState]:
    try:
        return [t.state for t in _study(tmp_path, "s").trials]
    except KeyError:  # not created yet
        return []


def _training(tmp_path: Path) -> bool:
    """Whether a trial is RUNNING with its MLflow run open."""
    try:
        return any(t.state == TrialState.RUNNING and "mlflow_run_id" in t.user_attrs
                   for t in _study(tmp_path, "s").trials)
    except KeyError:
        return False


def test_a_sweep_killed_midway_finishes_its_budget_when_started_again(prefect_api, tmp_path):
    proc = subprocess.Popen(_sweep_cmd(tmp_path, 4, "--parallel", "1"), cwd=tmp_path, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while _states(tmp_path).count(TrialState.COMPLETE) < 2 or not _training(tmp_path):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)  # no handler runs: trial 2 is left RUNNING in the study and in MLflow
    proc.wait()
    assert _states(tmp_path).count(TrialState.RUNNING) == 1
    again = subprocess.run(_sweep_cmd(tmp_path, 4, "--parallel", "1"), cwd=tmp_path, env=_env(),
                           capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    study = _study(tmp_path, "s")
    states = [t.state for t in study.trials]
    assert states.count(TrialState.COMPLETE) == 4 and states.count(TrialState.RUNNING) == 0
    assert states.count(TrialState.FAIL) == 1  # the one cut off, marked so and not counted
    (cut,) = [t for t in study.trials if t.state == TrialState.FAIL]
    assert cut.user_attrs["cut_off"] == "its sweep process is gone"
    parents, trials = _runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"  # the same parent run, continued
    finished = [r for r in trials if r.info.status == "FINISHED"]
    assert len(finished) == 4 and len({r.data.tags["sweep.trial"] for r in finished}) == 4  # none run twice
    assert [r.info.status for r in trials if r.info.status != "FINISHED"] == ["KILLED"]  # none left RUNNING
    done = {t.number for t in study.trials if t.state == TrialState.COMPLETE}
    assert {int(r.data.tags["sweep.trial"]) for r in finished} == done


def test_a_sweep_waits_for_a_slot_another_run_holds_and_never_uses_it(prefect_api, tmp_path):
    host = socket.gethostname()
    held = [CardLocks(), CardLocks()]
    assert held[0].try_lock(f"{host}-cpu0") and held[1].try_lock(f"{host}-cpu1")
    proc = subprocess.Popen(_sweep_cmd(tmp_path, 2), cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any("every slot is held by another gpuflow run; waiting" in line for line in list(lines)):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.2)
        time.sleep(3)  # it goes on waiting
        assert proc.poll() is None
        assert _states(tmp_path) == []  # no trial asked for, none started
        held[1].release()
        proc.wait(timeout=400)
        reader.join(timeout=30)
        out = "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
        for lock in held:
            lock.release()
    assert proc.returncode == 0, out[-3000:]
    assert "every slot is held by another gpuflow run; waiting" in out
    _, trials = _runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert len(trials) == 2 and {r.data.tags["sweep.slot"] for r in trials} == {"cpu1"}
    assert _most_at_once(trials) == 1


SCRIPT = '''\
"""A user's script, unchanged for the sweep: its own arguments, its own mlflow.log_metric calls."""
import argparse, math, os, time

import mlflow
import torch

from gpuflow.training import helper

p = argparse.ArgumentParser()
p.add_argument("--lr", type=float, required=True)
p.add_argument("--width", type=int, required=True)
p.add_argument("--epochs", type=int, default=4)
a = p.parse_args()
with open(os.path.join(os.environ["GPUFLOW_OUTPUT_DIR"], "args.txt"), "w") as f:
    f.write(f"{a.lr} {a.width}")
mlflow.start_run()  # attaches to the trial's run (MLFLOW_RUN_ID)
score = lambda e: (e + 1) * (1.0 - abs(math.log10(a.lr) + 2) / 5) + a.width / 1000  # best near lr=0.01
for e in range(a.epochs):
    time.sleep(1.5)  # an epoch outlasts the flow's poll of the run's metrics
    mlflow.log_metric("val_score", score(e), step=e)
model = torch.nn.Linear(4, a.width)
torch.save(model.state_dict(), os.path.join(helper.output_dir(), "model.pt"))
helper.declare_model("torch.nn:Linear", in_features=4, out_features=a.width)
'''


def test_a_scripts_sweep_fills_its_arguments_prunes_from_its_own_mlflow_metric_and_registers_the_best(
        prefect_api, tmp_path, monkeypatch):
    from gpuflow.flows.sweep import sweep

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(SCRIPT)
    space = _space(tmp_path, "lr: {type: float, low: 1.0e-4, high: 1.0, log: true}\n"
                             "width: {type: int, low: 2, high: 8}\n")
    study = optuna.create_study(study_name="script", storage=f"sqlite:///{tmp_path / 'optuna.db'}",
                                direction="maximize")
    for lr in (0.01, 0.02, 1.0):  # two good trials, then one the median pruner must stop
        study.enqueue_trial({"lr": lr, "width": 4})
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = sweep(script=str(tmp_path / "train.py"), script_args=["--lr", "{lr}", "--epochs", "4"], space=space,
                trials=3, parallel="1", pruner="median", optimize="val_score", gpus="cpu", study="script",
                tracking_uri=uri, runs_dir=str(tmp_path / "runs"), registered_model="scripted")
    study = _study(tmp_path, "script")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.COMPLETE, TrialState.PRUNED]
    (parent,), trials = _runs(uri)
    assert parent.info.status == "FINISHED" and len(trials) == 3
    for r in trials:  # {lr} filled in place, width (no placeholder) appended as --width=4
        t = study.trials[int(r.data.tags["sweep.trial"])]
        args = (tmp_path / "runs" / r.info.run_id / "outputs" / "args.txt")
        assert not args.exists() or args.read_text() == f"{t.params['lr']} 4"
        assert r.data.params["gpuflow.script_args"] == json.dumps(["--lr", str(t.params["lr"]), "--epochs", "4",
                                                                    "--width=4"])
    bad = next(r for r in trials if r.data.tags["sweep.trial"] == "2")
    assert bad.info.status == "FINISHED" and bad.data.tags["sweep.pruned"].startswith("after epoch ")
    assert len(mlflow.MlflowClient().get_metric_history(bad.info.run_id, "val_score")) < 4  # stopped early
    best = study.best_trial
    assert best.number == 0 and out["best_value"] == pytest.approx(4.004)
    client = mlflow.MlflowClient()
    (version,) = client.search_model_versions("name='scripted'")
    assert version.run_id == best.user_attrs["mlflow_run_id"] and out["promoted"] is True
    assert client.get_model_version_by_alias("scripted", "champion").version == version.version


def test_a_scripts_sweep_over_a_metric_it_never_logs_says_so_at_its_first_metrics(prefect_api, tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    cmd = [str(BIN / "gpuflow"), "sweep", "--script", "train.py", "--trials", "1", "--optimize", "loss",
           "--space", _space(tmp_path, "lr: {type: float, low: 1.0e-4, high: 1.0, log: true}\n"), "--gpus", "cpu",
           "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "--", "--lr", "{lr}", "--width", "4",
           "--epochs", "6"]
    out = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    console = out.stdout + out.stderr
    assert out.returncode == 2 and console.strip().splitlines()[-1].startswith(
        "gpuflow sweep: optimize='loss': the trial logged no such metric (it logged val_score); "), console[-3000:]
    warned = re.search(r"\S+-t0 has logged val_score but no 'loss' so far: if it never does, the sweep fails", console)
    trained = re.search(r"Task run 'launch-script-\w+' - Finished", console)  # its 6 epochs of 1.5 s
    assert warned and trained and warned.start() < trained.start(), console[-3000:]


@pytest.mark.parametrize("space, args, says", [
    ("lr: {type: float, low: 0.1, high: 1}", [], "needs optimize="),
    ("lr: {type: float, low: 0.1, high: 1}", ["--optimize", "acc", "--", "--lr", "{lrr}"],
     "{lrr} in '{lrr}' is not in space="),
    ("'--lr': {type: float, low: 0.1, high: 1}", ["--optimize", "acc"], "'--lr' cannot name a script argument"),
    ("lr: {type: float, low: 0.1, high: 1}", ["--optimize", "acc", "--strategy", "dp"], "strategy"),
])
def test_a_scripts_bad_sweep_is_refused_before_anything_starts(tmp_path, capsys, space, args, says):
    (tmp_path / "train.py").write_text("print('never run')\n")
    code = main(["sweep", "--script", str(tmp_path / "train.py"), "--space", _space(tmp_path, space),
                 "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", *args])
    err = capsys.readouterr().err
    assert code == 2 and says in err, err
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "optuna.db").exists()


SNAPSHOT_SCRIPT = '''\
import argparse, os, mlflow, torch
p = argparse.ArgumentParser()
p.add_argument("--lr", type=float, required=True)
a = p.parse_args()
resumed = os.path.exists("snapshot.pt")  # the DDP tutorial's way: a fixed path, resumed when present
start = torch.load("snapshot.pt")["epoch"] if resumed else 0
with open(os.path.join(os.environ["GPUFLOW_OUTPUT_DIR"], "resumed.txt"), "w") as f:
    f.write(f"{resumed} {open('data/seen.txt').read()}")  # a relative data path resolves as in the project
mlflow.start_run()
for e in range(start, 2):
    torch.save({"epoch": e + 1, "lr": a.lr}, "snapshot.pt")
    mlflow.log_metric("score", a.lr * (e + 1), step=e)
'''


def test_each_scripts_trial_runs_in_a_folder_of_its_own_and_never_resumes_anothers_snapshot(
        prefect_api, tmp_path, monkeypatch):
    from gpuflow.flows.sweep import sweep

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(SNAPSHOT_SCRIPT)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "seen.txt").write_text("data")
    import torch

    torch.save({"epoch": 2, "lr": 9.0}, tmp_path / "snapshot.pt")  # an earlier run's, in the project folder
    space = _space(tmp_path, "lr: {type: choice, values: [0.1, 0.2]}\n")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(SweepError, match="nothing registered: best trial .* declared no model"):  # a snapshot alone
        sweep(script=str(tmp_path / "train.py"), script_args=["--lr", "{lr}"], space=space, trials=2, parallel="1",
              pruner="none", optimize="score", gpus="cpu", cpu_processes=1, study="own", tracking_uri=uri,
              runs_dir=str(tmp_path / "runs"), registered_model="own", collect=["snapshot.pt"])
    (parent,), trials = _runs(uri)
    assert len(trials) == 2 and all(r.info.status == "FINISHED" for r in trials)
    for r in trials:
        folder = tmp_path / "runs" / r.info.run_id
        assert (folder / "outputs" / "resumed.txt").read_text() == "False data"  # neither resumed another's
        lr = float(r.data.params["gpuflow.script_args"].split('"')[3])
        assert torch.load(folder / "work" / "snapshot.pt")["lr"] == lr  # its own file, in its own folder
        assert r.data.metrics["score"] == pytest.approx(2 * lr)
    assert torch.load(tmp_path / "snapshot.pt")["lr"] == 9.0  # the project's own file untouched
