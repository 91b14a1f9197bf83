"""What a user meets at the command line (gpuflow/flows/cli.py): stdout holds the JSON result
alone, refusals are one short line before any server or data work, Ctrl-C works whoever
started the command, and the run has one name from its start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jsonschema
import psutil
import pytest

from gpuflow.flows.infer import evaluate_model
from tests.helpers import child_env
from tests.test_stop import HANG_GUARD_S, the_run, wait_for_first_epoch
from tests.test_user_code import api_url, gpuflow  # noqa: F401  (the session's Prefect server)

GPUFLOW = [sys.executable, "-m", "gpuflow.flows"]
STARTS_API = "starting a temporary Prefect API"

NOISY = """
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    print("hello from nets, on import")
    class Net(nn.Module):
        def __init__(self, num_classes=3):
            super().__init__()
            self.fc = nn.Linear(4, num_classes)
        def forward(self, x):
            return self.fc(x)
    def datasets(root):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(40, 4, generator=g)
        return TensorDataset(x, torch.arange(40) % 3), TensorDataset(x[:8], torch.arange(8) % 3)
"""


def project(folder: Path) -> Path:
    (folder / "proj").mkdir(parents=True)
    (folder / "proj" / "__init__.py").write_text("")
    (folder / "proj" / "nets.py").write_text(textwrap.dedent(NOISY))
    return folder


def local(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """`gpuflow` with no Prefect server set: it would start its temporary API."""
    e = child_env(PREFECT_HOME=str(cwd / "prefect-home"), **env)
    e.pop("PREFECT_API_URL", None)
    return subprocess.run([*GPUFLOW, *args], cwd=cwd, env=e, capture_output=True, text=True, timeout=300)


def test_what_user_code_prints_goes_to_stderr_and_stdout_is_the_result_alone(tmp_path, api_url):
    cwd = project(tmp_path)
    out = gpuflow(["run", "--model", "proj.nets:Net", "--dataset", "proj.nets:datasets", "--epochs", "1",
                   "--gpus", "cpu", "--cpu-processes", "1"], cwd, api_url)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["status"] == "FINISHED"  # stdout parses whole: nothing ahead of the JSON
    assert "hello from nets, on import" in out.stderr


@pytest.mark.parametrize("ref", ["proj.nets:Nope", "proj.nowhere:Net", "proj.nets:Net.nothing"])
def test_a_reference_that_does_not_resolve_is_refused_before_any_server_or_data(tmp_path, ref):
    cwd = project(tmp_path)
    out = local(["run", "--model", ref, "--gpus", "cpu"], cwd)
    assert out.returncode == 2, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("gpuflow run: model ") and ref in last and "Traceback" not in out.stderr
    assert STARTS_API not in out.stderr  # no Prefect API was started for it
    assert not (cwd / "data").exists() and not (cwd / "mlflow.db").exists() and not (cwd / "runs").exists()
    assert out.stdout == ""


def test_a_resume_file_that_is_not_there_is_refused_before_any_server_or_data(tmp_path):
    out = local(["run", "--resume", "missing.pt", "--gpus", "cpu"], tmp_path)
    assert out.returncode == 2 and STARTS_API not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"gpuflow run: resume='missing.pt': checkpoint '{tmp_path.resolve() / 'missing.pt'}' does not exist; "
        "check the resume path (or use auto or never)")
    assert not (tmp_path / "data").exists() and not (tmp_path / "mlflow.db").exists()


def test_a_one_device_command_refuses_several_devices_before_any_server(tmp_path):
    out = local(["evaluate", "--gpus", "3"], tmp_path)
    assert out.returncode == 2 and STARTS_API not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines() == [
        "gpuflow evaluate: gpus='3': gpus=3 asks for several devices but this step uses one; name one card "
        "('3,'), ask for '1', or use cpu; to name physical GPU 3, write '3,'"]


def test_devices_this_host_does_not_have_are_refused_before_any_server(tmp_path):
    out = local(["run", "--gpus", "99", "--epochs", "1"], tmp_path)
    assert out.returncode == 2 and STARTS_API not in out.stderr, out.stderr[-3000:]
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("gpuflow run: gpus=99 asks for ") and ("none are usable" in line or "at most" in line), line
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "runs").exists()


def test_an_evaluation_of_a_champion_there_is_not_is_refused_before_any_server(tmp_path):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = local(["evaluate", "--version", "champion", "--gpus", "cpu", "--tracking-uri", uri], tmp_path)
    assert out.returncode == 2 and STARTS_API not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines() == [f"gpuflow evaluate: no MLflow store at '{tmp_path / 'mlflow.db'}': "
                                               "nothing has been trained here; run `gpuflow run` in this folder "
                                               "first, set MLFLOW_TRACKING_URI (or --tracking-uri) to your store, "
                                               "or pass --checkpoint FILE"]
    mlflow.MlflowClient(uri).create_registered_model("gpuflow-model")  # a model without the alias
    out = local(["evaluate", "--version", "champion", "--gpus", "cpu", "--tracking-uri", uri], tmp_path)
    assert out.returncode == 2 and STARTS_API not in out.stderr, out.stderr[-3000:]
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("gpuflow evaluate: model 'gpuflow-model' has no 'champion' yet"), line


def test_prefects_count_of_what_it_still_sends_at_exit_does_not_follow_gpuflows_last_line():
    """Prefect's EventsWorker warns "Still processing items" while it drains at exit, after the CLI's last line."""
    probe = ("import logging, gpuflow.flows.cli; "
             "[logging.getLogger(n).warning('Still processing items: 5 items remaining...') "
             "for n in ('EventsWorker', 'APILogWorker')]")
    out = subprocess.run([sys.executable, "-c", probe], env=child_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "Still processing" not in out.stderr, out.stderr[-3000:]


@pytest.mark.parametrize("args", [["--run-name", "x" * 120_000],
                                  ["--model", "proj.nets:Net", "--dataset", "proj.nets:datasets",
                                   "--model-args", json.dumps({"width": "w" * 120_000})]])
def test_a_refusal_that_echoes_a_huge_value_cuts_it(tmp_path, api_url, args):
    out = gpuflow(["run", "--gpus", "cpu", *args], project(tmp_path), api_url)
    assert out.returncode == 2, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert len(last) < 1500 and "characters cut" in last, len(last)


def test_a_version_is_a_number_or_champion_in_the_cli_and_the_prefect_form():
    schema = evaluate_model.parameters.model_dump_for_openapi()
    jsonschema.validate({"version": 1}, schema)  # what `-p version=1` sends
    jsonschema.validate({"version": "champion"}, schema)
    from gpuflow.flows.params import EvaluateParams

    assert EvaluateParams(version=1).version == "1" and EvaluateParams(version="2").version == "2"
    with pytest.raises(ValueError, match="not a version"):
        EvaluateParams(version=0)


def test_ctrl_c_stops_a_run_started_with_sigint_ignored(tmp_path):
    """`gpuflow run &` from a script, or a CI runner, starts it with SIGINT ignored."""
    db = tmp_path / "mlflow.db"
    cmd = [*GPUFLOW, "run", "--dataset", "synthetic", "--synthetic-size", "60000", "--epochs", "50", "--gpus", "cpu",
           "--tracking-uri", f"sqlite:///{db}", "--runs-dir", str(tmp_path / "runs")]
    env = child_env(PREFECT_HOME=str(tmp_path / "ph"))
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "err.log", "w"), start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        wait_for_first_epoch(proc, db, tmp_path)
        tree = [proc, *psutil.Process(proc.pid).children(recursive=True)]
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(HANG_GUARD_S) == 130, (tmp_path / "err.log").read_text()[-3000:]
        _, alive = psutil.wait_procs(tree, timeout=60)
        assert not alive, [p.cmdline()[:4] for p in alive]
        run = the_run(db)
        assert run.info.status == "KILLED" and "Ctrl-C" in run.data.tags["error"]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
