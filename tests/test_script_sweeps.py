"""A script's sweep as nanoGPT's user runs one: from a project an earlier run left its output folder, logs and stores
in. Each trial's working folder links the project's inputs (its code, its data) and nothing a run writes, so each
trial writes and logs its own checkpoint; a pruned trial is one line; a sweep that registers nothing says so and
fails; a GPU count per trial on the CPU is refused before anything runs.

Real parts: `gpuflow sweep` in a subprocess on the session's Prefect server, torchrun trials on CPU slots, a SQLite
MLflow store and Optuna study in the project, as the defaults put them.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import mlflow
import optuna
import pytest
import torch

from tests.test_scripts import api_url  # noqa: F401  (a fixture)
from tests.test_user_code import gpuflow

# nanoGPT's way: its data at a path relative to the project, its checkpoint and log at fixed paths it makes itself
NANO = """
    import argparse, os, time, torch
    from gpuflow.training import helper

    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--declare", type=int, default=1)
    a = p.parse_args()
    assert open("data/shakespeare_char/train.bin").read() == "tokens"
    out_dir = "out-shakespeare-char"
    os.makedirs(out_dir, exist_ok=True)
    model = torch.nn.Linear(4, 2)
    if a.declare:
        helper.declare_model("torch.nn:Linear", in_features=4, out_features=2)
    for it in range(1, 4):
        time.sleep(1.5)  # an iteration outlasts the flow's poll of the run's metrics
        torch.save({"model": model.state_dict(), "iter_num": it, "lr": a.lr}, os.path.join(out_dir, "ckpt.pt"))
        with open("train.log", "a") as f:
            f.write(f"iter {it}\\n")
        helper.report({"val_loss": (1 + abs(a.lr - 0.01)) * (1 + 1 / it)}, step=it)
"""


def nano_project(folder: Path) -> Path:
    """A project after an earlier run: its output folder, its log, its stores."""
    (folder / "data" / "shakespeare_char").mkdir(parents=True)
    (folder / "data" / "shakespeare_char" / "train.bin").write_text("tokens")
    (folder / "train.py").write_text(textwrap.dedent(NANO))
    (folder / "out-shakespeare-char").mkdir()
    torch.save({"model": torch.nn.Linear(4, 2).state_dict(), "iter_num": 5000, "lr": 9.0},
               folder / "out-shakespeare-char" / "ckpt.pt")
    (folder / "train.log").write_text("the earlier run's log\n")
    (folder / "space.yaml").write_text("lr: {type: float, low: 1.0e-4, high: 1.0, log: true}\n")
    return folder


def sweep(folder: Path, api: str, *args: str, script_args: tuple[str, ...] = ()):
    out = gpuflow(["sweep", "--script", "train.py", "--space", "space.yaml", "--optimize", "val_loss", "--gpus",
                   "cpu", "--parallel", "1", "--tracking-uri", f"sqlite:///{folder / 'mlflow.db'}", *args, "--",
                   "--lr", "{lr}", *script_args], folder, api)
    return out, out.stdout + out.stderr


def trial_runs(folder: Path) -> list:
    runs = mlflow.MlflowClient(f"sqlite:///{folder / 'mlflow.db'}").search_runs(
        [e.experiment_id for e in mlflow.MlflowClient(f"sqlite:///{folder / 'mlflow.db'}").search_experiments()])
    return sorted((r for r in runs if "sweep.trial" in r.data.tags), key=lambda r: int(r.data.tags["sweep.trial"]))


def test_each_trial_links_only_the_projects_inputs_and_logs_its_own_checkpoint_and_a_pruned_one_is_one_line(
        tmp_path, api_url):  # noqa: F811
    folder = nano_project(tmp_path / "nanogpt")
    earlier = (folder / "out-shakespeare-char" / "ckpt.pt").read_bytes()
    study = optuna.create_study(study_name="nano", storage=f"sqlite:///{folder / 'optuna.db'}")
    for lr in (0.01, 0.02, 1.0):  # two good trials, then one the median pruner stops at its first report
        study.enqueue_trial({"lr": lr})
    out, console = sweep(folder, api_url, "--trials", "3", "--study", "nano", "--registered-model", "nano",
                         "--cpu-processes", "1")
    assert out.returncode == 0, console[-4000:]
    assert (folder / "out-shakespeare-char" / "ckpt.pt").read_bytes() == earlier  # the user's own, untouched
    assert (folder / "train.log").read_text() == "the earlier run's log\n"
    runs = trial_runs(folder)
    client = mlflow.MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    assert [r.data.params["args.lr"] for r in runs] == ["0.01", "0.02", "1.0"]  # one param each, to sort by
    for r in runs:
        work = folder / "runs" / r.info.run_id / "work"
        # links to the project's inputs alone: no output folder, store, log or runs folder
        assert {p.name for p in work.iterdir() if p.is_symlink()} == {"data", "space.yaml", "train.py"}
        assert not (work / "out-shakespeare-char").is_symlink()
        assert not any((work / n).exists() for n in ("mlflow.db", "optuna.db", "runs"))
        own = torch.load(work / "out-shakespeare-char" / "ckpt.pt", weights_only=True)
        assert own["lr"] == float(r.data.params["args.lr"])  # its own checkpoint, in its own folder
    for r in runs[:2]:
        assert "gpuflow.skipped" not in r.data.tags, r.data.tags["gpuflow.skipped"]
        assert {a.path for a in client.list_artifacts(r.info.run_id, "checkpoints")} == {"checkpoints/ckpt.pt"}
    (version,) = client.search_model_versions("name='nano'")
    assert version.run_id == runs[0].info.run_id
    pruned = [line for line in console.splitlines() if "pruned after" in line]
    assert len(pruned) == 1 and "trial 2: pruned after epoch" in pruned[0] and "val_loss" in pruned[0], pruned
    assert "Stopped" not in console and "| ERROR" not in console and "Traceback" not in console, console[-4000:]


def test_a_sweep_that_registers_nothing_says_why_and_exits_non_zero(tmp_path, api_url):  # noqa: F811
    folder = nano_project(tmp_path / "nanogpt")
    out, console = sweep(folder, api_url, "--trials", "1", "--study", "plain", "--pruner", "none",
                         "--cpu-processes", "1", script_args=("--declare", "0"))
    last = console.strip().splitlines()[-1]
    assert out.returncode == 2 and last.startswith("gpuflow sweep: sweep plain: nothing registered: best trial 0 ("), \
        console[-3000:]
    assert "declared no model: call gpuflow.training.helper.declare_model(" in last
    (run,) = trial_runs(folder)
    assert run.info.status == "FINISHED"  # the trial itself went well; its checkpoint is logged
    assert mlflow.MlflowClient(f"sqlite:///{folder / 'mlflow.db'}").list_artifacts(run.info.run_id, "checkpoints")


def test_gpus_per_trial_on_a_host_without_a_gpu_is_refused_before_any_trial(tmp_path, api_url):  # noqa: F811
    folder = nano_project(tmp_path / "nanogpt")
    out, console = sweep(folder, api_url, "--trials", "1", "--gpus-per-trial", "2")
    last = console.strip().splitlines()[-1]
    assert out.returncode == 2 and last.startswith("gpuflow sweep: gpus_per_trial=2 asks for GPUs but the trials "
                                                   "run on the CPU (gpus=cpu); "), console[-3000:]
    assert "use cpu_processes=2 (--cpu-processes)" in last
    assert not (folder / "optuna.db").exists() and not (folder / "runs").exists()


@pytest.mark.parametrize("args, params", [
    (["config/train.py", "--lr", "0.01", "--batch-size=32", "--compile", "--offset", "-1", "--n", "1", "--n", "2"],
     {"args.0": "config/train.py", "args.lr": "0.01", "args.batch-size": "32", "args.compile": "true",
      "args.offset": "-1", "args.n": "2"}),
    (["--a/b:c", "x" * 7000], {"args.a_b_c": "x" * 6000}),
])
def test_a_scripts_arguments_become_one_param_each_within_mlflows_limits(args, params):
    from gpuflow.flows.launchers import argument_params

    assert argument_params(args) == params


def test_a_trial_folder_makes_afresh_every_folder_an_earlier_run_wrote_to_even_behind_a_link(tmp_path):
    from gpuflow.flows.trialfolder import TrialFolder

    project, elsewhere = tmp_path / "proj", tmp_path / "scratch"
    (elsewhere / "sub").mkdir(parents=True)
    (elsewhere / "sub" / "last.ckpt").write_bytes(b"")
    (elsewhere / "notes.txt").write_text("")
    (project / "pkg").mkdir(parents=True)
    (project / "pkg" / "net.py").write_text("")
    (project / "out").symlink_to(elsewhere)
    (project / "snap.bin").write_text("")
    work = TrialFolder.of(project, ["snap*"], []).make(tmp_path / "work")
    links = {str(p.relative_to(work)) for p in work.rglob("*") if p.is_symlink()}
    assert links == {"pkg", "out/notes.txt"}
    assert (work / "out" / "sub").is_dir() and not any((work / "out" / "sub").iterdir())
    assert os.readlink(work / "out" / "notes.txt") == str(project / "out" / "notes.txt")
