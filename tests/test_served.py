"""`make server` + `make serve` as a user runs them, on loopback with an isolated PREFECT_HOME:
a deployment run from the CLI, listings, the nightly retrain fired by the server's own
scheduler, a cancel from the UI (the API the UI calls), and Ctrl-C to `make serve`."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlflow
import psutil
import pytest

from gpuflow.flows.api import server_environment
from tests.helpers import EXAMPLE, ROOT
from tests.servers import BIN, ServerProcess, prefect_server

HANG_GUARD_S = 120


def _prefect(args: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "prefect"), *args], env=env, capture_output=True, text=True, timeout=timeout)


def _api(api: str, path: str, body: dict | None = None):
    req = urllib.request.Request(api + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _flow_runs(api: str, deployment: str) -> list[dict]:
    dep = _api(api, f"/deployments/name/{deployment}")
    return [r for r in _api(api, "/flow_runs/filter", {}) if r["deployment_id"] == dep["id"]]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A Prefect server (scheduler on) and `python -m gpuflow.flows.serve` with the nightly
    retrain's cron set to fire once, two minutes from now, from a folder holding the user
    package `myproj` (examples/myproj), which the operator allowed."""
    base = tmp_path_factory.mktemp("served")
    home = base / "prefect-home"
    home.mkdir()
    fire = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=2)
    server_env = dict(server_environment(), PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="5")  # `gpuflow server`'s
    server, api = prefect_server(home, server_env)
    shutil.copytree(EXAMPLE / "myproj", base / "myproj")  # a user package in serve's folder
    env = dict(os.environ, PREFECT_API_URL=api, PREFECT_HOME=str(home), OMP_NUM_THREADS="1",
               MLFLOW_TRACKING_URI=f"sqlite:///{base / 'mlflow.db'}",
               GPUFLOW_RETRAIN_CRON=f"{fire.minute} {fire.hour} * * *", GPUFLOW_TIMEZONE="UTC",
               GPUFLOW_ALLOW_CODE="myproj")  # the operator's allowlist: `gpuflow serve --allow-code myproj`
    with server:
        serve_cmd = [sys.executable, "-m", "gpuflow.flows.serve"]
        with ServerProcess(serve_cmd, api + "/health", env, base / "serve.log", cwd=base) as serving:
            deadline = time.monotonic() + 120
            while _prefect(["deployment", "inspect", "retrain/nightly"], env).returncode != 0:
                assert time.monotonic() < deadline, (base / "serve.log").read_text()[-3000:]
                time.sleep(2)
            yield {"api": api, "env": env, "base": base, "db": base / "mlflow.db", "serving": serving,
                   "fire": fire}


def _client(served) -> mlflow.MlflowClient:
    return mlflow.MlflowClient(f"sqlite:///{served['db']}")


def test_served_ddp_deployment_runs_from_the_cli_and_logs_to_mlflow(served):
    """`prefect deployment run 'train-pipeline/ddp' --watch`, then the listings a user types."""
    env, base = served["env"], served["base"]
    run = _prefect(["deployment", "run", "train-pipeline/ddp", "-p", "epochs=2", "-p", "gpus=cpu",
                    "-p", "experiment=served", "--watch"], env, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:] + (base / "serve.log").read_text()[-3000:]
    listings = [_prefect([kind, "ls"], env) for kind in ("deployment", "flow-run")]
    for ls in listings:  # the first commands a user types (422 with fastapi >= 0.151)
        assert ls.returncode == 0, ls.stdout[-2000:] + ls.stderr[-2000:]
    assert "train-pipeline/ddp" in listings[0].stdout.replace("\n", "")
    limit = _prefect(["global-concurrency-limit", "inspect", f"gpuflow-devices-{os.uname().nodename}"], env)
    assert limit.returncode == 0 and "limit=1" in limit.stdout, limit.stdout
    client = _client(served)
    runs = client.search_runs([client.get_experiment_by_name("served").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.tags["prefect.deployment"] == "ddp" and runs[0].data.tags["world_size"] == "2"
    assert len(client.get_metric_history(runs[0].info.run_id, "val_accuracy")) == 2
    assert client.search_model_versions(f"run_id='{runs[0].info.run_id}'")


WATCH_LOST = "the events or logs stream closed unexpectedly"


def _flow_run_id(stdout: str) -> str:
    return next(line.split()[-1] for line in stdout.splitlines() if "UUID" in line)


def test_a_served_run_names_only_the_packages_and_folders_the_operator_allowed(served):
    env, api = served["env"], served["api"]
    user = ["-p", "model=myproj.nets:Net", "-p", "dataset=myproj.data:datasets", "-p", "epochs=1", "-p", "gpus=cpu",
            "-p", "registered_model=blobs"]
    ok = _prefect(["deployment", "run", "train-pipeline/ddp", *user, "-p", "experiment=allowed", "--watch"], env,
                  timeout=400)
    assert ok.returncode == 0, ok.stdout[-3000:] + (served["base"] / "serve.log").read_text()[-3000:]
    client = _client(served)
    (run,) = client.search_runs([client.get_experiment_by_name("allowed").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["model"] == "myproj.nets:Net"
    # a served evaluation's scores, where its caller sees them
    scored = _prefect(["deployment", "run", "evaluate-model/evaluate", "-p", "registered_model=blobs",
                       "-p", "version=1", "-p", "gpus=cpu", "--watch"], dict(env, COLUMNS="1000"), timeout=300)
    assert scored.returncode == 0 and "blobs v1 on " in scored.stdout and " accuracy " in scored.stdout, scored.stdout
    marker = served["base"] / "pwned"
    # An allowed module imports torch, which imports os: a path through attributes reached os.system,
    # called with model_args (model) or data_root (dataset) in the served flow's own process.
    escape = "myproj.nets:nn.functional.torch.os.system"
    refused = {("model=myproj_evil.nets:Net",): "package 'myproj_evil' is not allowed",
               ("objective=os:system",): "package 'os' is not allowed",
               ("data_root=/etc",): "data_root='/etc' is outside the folders",
               (f"model={escape}", f'model_args={{"command": "touch {marker}"}}'): "not a path through other objects",
               (f"dataset={escape}", f"data_root=touch {marker}"): "not a path through other objects",
               # the run's records (params, environment report, checkpoint) go to the operator's store alone
               (f"tracking_uri=sqlite:///{served['base'].parent / 'elsewhere' / 'x.db'}",):
                   "records to the operator's tracking store",
               ("tracking_uri=http://127.0.0.1:9",): "records to the operator's tracking store"}
    serve_log = served["base"] / "serve.log"
    start = len(serve_log.read_text())
    # all refused runs at once (the serve process runs them side by side; each fails at its door)
    calls = {bad: subprocess.Popen([str(BIN / "prefect"), "deployment", "run", "train-pipeline/ddp", *user,
                                    *[arg for value in bad for arg in ("-p", value)], "-p", "experiment=refused",
                                    "--watch"], env=dict(env, COLUMNS="1000"), stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True) for bad in refused}
    outs = {bad: (call.communicate(timeout=300)[0], call.returncode) for bad, call in calls.items()}
    for bad, message in refused.items():
        stdout, code = outs[bad]
        assert code != 0, stdout[-2000:]
        flow_run = _api(api, f"/flow_runs/{_flow_run_id(stdout)}")
        state = flow_run["state"]
        assert state["type"] == "FAILED" and message in state["message"], (bad, state)
        # the caller watching sees the reason in one line, not Prefect's traceback; so does the serve terminal
        if WATCH_LOST in stdout:  # Prefect's --watch gave up on its own websocket (PrefectHQ/prefect#22549), seen
            # once in ~15 runs of 7 watches at once: the caller reads the run's logs, which --watch streams
            stdout = _prefect(["flow-run", "logs", flow_run["id"]], dict(env, COLUMNS="1000")).stdout
        assert message in stdout and "Traceback" not in stdout, stdout[-3000:]
        deadline = time.monotonic() + 10  # the serve process relays the run's output as it comes
        named = f"Flow run '{flow_run['name']}' - "
        while not (said := [line for line in serve_log.read_text()[start:].splitlines() if named in line
                            and message in line]):
            assert time.monotonic() < deadline, serve_log.read_text()[start:][-3000:]
            time.sleep(0.2)
        assert len(said) == 1, "\n".join(said)
    for message in set(refused.values()):  # each reason once per run that met it, never repeated
        said = [line for line in serve_log.read_text()[start:].splitlines() if message in line]
        assert len(said) == list(refused.values()).count(message), "\n".join(said)  # in full, not cut by pytest
    assert "Traceback" not in serve_log.read_text()[start:], serve_log.read_text()[start:][-3000:]
    assert not marker.exists()  # the shell command never ran
    assert client.get_experiment_by_name("refused") is None  # refused before any MLflow run
    assert not (served["base"].parent / "elsewhere").exists()


def test_a_served_run_takes_no_command_environment_or_policy_from_its_job_variables(served, tmp_path):
    """An API caller's job variables (a command, a wider policy, PYTHONPATH to their code) change nothing: the run
    is refused by the operator's policy as without them, says it ignored them, and nothing the caller named ran."""
    api, marker = served["api"], served["base"] / "pwned-by-job-variables"
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "net.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nimport torch\nNet = torch.nn.Linear\n")
    wide = json.dumps({"packages": ["os"], "folders": ["/"], "home_store": "", "stores": []})
    (tmp_path / "policy.json").write_text(wide)
    dep = _api(api, "/deployments/name/train-pipeline/ddp")
    run = _api(api, f"/deployments/{dep['id']}/create_flow_run", {
        "parameters": {"model": f"{evil / 'net.py'}:Net", "epochs": 1, "gpus": "cpu", "experiment": "jobvars"},
        "job_variables": {"command": f"sh -c 'id > {marker}'", "working_dir": str(evil),
                          "env": {"GPUFLOW_POLICY": wide, "GPUFLOW_POLICY_FILE": str(tmp_path / "policy.json"),
                                  "GPUFLOW_ALLOW_PATHS": "/", "PYTHONPATH": str(evil)}}})
    deadline = time.monotonic() + 180
    while not (state := _api(api, f"/flow_runs/{run['id']}")["state"])["type"] in ("FAILED", "COMPLETED", "CRASHED"):
        assert time.monotonic() < deadline, state
        time.sleep(1)
    assert state["type"] == "FAILED" and "is outside the folders this served deployment may use" in state["message"]
    said = "ignored the job variables sent with this run (command, env, working_dir)"
    while said not in (logs := " ".join(line["message"] for line in _api(api, "/logs/filter", {
            "logs": {"flow_run_id": {"any_": [run["id"]]}}}))):  # the run's lines reach the server in batches
        assert time.monotonic() < deadline, logs[-2000:]
        time.sleep(1)
    assert not marker.exists()


def test_a_served_evaluation_never_runs_the_code_a_registered_checkpoint_names(served, tmp_path):
    """A version whose checkpoint's config names `os:system` (written by whoever could write to the
    store): the served evaluate refuses it at the door, in the evaluation child, before importing it."""
    import torch

    env, api, base = served["env"], served["api"], served["base"]
    marker = tmp_path / "pwned"
    evil = {"model": {}, "num_classes": 10,
            "config": {"model": "os:system", "model_args": {"command": f"id > {marker}"}, "dataset": "digits",
                       "code_root": str(base)}}
    torch.save(evil, tmp_path / "epoch-0001.pt")
    client = _client(served)
    exp = client.create_experiment("planted", artifact_location=str(base / "planted-artifacts"))
    run_id = client.create_run(exp).info.run_id
    client.log_artifact(run_id, str(tmp_path / "epoch-0001.pt"), "checkpoints")
    client.set_terminated(run_id)
    client.create_registered_model("planted")
    client.create_model_version("planted", f"runs:/{run_id}/checkpoints", run_id=run_id)
    out = _prefect(["deployment", "run", "evaluate-model/evaluate", "-p", "registered_model=planted", "-p", "version=1",
                    "-p", "gpus=cpu", "--watch"], env, timeout=300)
    state = _api(api, f"/flow_runs/{_flow_run_id(out.stdout)}")["state"]
    assert state["type"] == "FAILED" and "package 'os' is not allowed" in state["message"], state
    assert "checkpoint epoch-0001.pt: model" in state["message"]
    assert not marker.exists()  # on main this file held `uid=0(root)`


BOOM = """\
import torch
from torch.utils.data import Dataset


class Unreadable(Dataset):  # its first samples read (the preflight's batch), the rest fail in the ranks
    def __len__(self):
        return 200

    def __getitem__(self, i):
        if i >= 40:
            raise ValueError(f"sample {i} is unreadable")
        return torch.zeros(8), i % 3


def datasets(root):
    return Unreadable(), Unreadable()
"""


def test_a_served_run_that_fails_in_its_ranks_says_why_in_one_line_in_its_state_and_the_serve_terminal(served):
    """The state message (what --watch and the UI show) and the serve terminal's line under the run's name are the
    rank's exception in one line: no Prefect traceback, no torchrun summary before it (both in the run's log file)."""
    env, api, base = served["env"], served["api"], served["base"]
    (base / "myproj" / "boom.py").write_text(BOOM)
    serve_log = base / "serve.log"
    start = len(serve_log.read_text())
    out = _prefect(["deployment", "run", "train-pipeline/ddp", "-p", "model=myproj.nets:Net", "-p",
                    "dataset=myproj.boom:datasets", "-p", "epochs=1", "-p", "gpus=cpu", "-p", "experiment=boom",
                    "--watch"], dict(env, COLUMNS="1000"), timeout=400)
    flow_run = _api(api, f"/flow_runs/{_flow_run_id(out.stdout)}")
    message = flow_run["state"]["message"]
    assert flow_run["state"]["type"] == "FAILED" and "is unreadable" in message, message
    assert "\n" not in message and "Root Cause" not in message and "exitcode" not in message, message
    named = f"Flow run '{flow_run['name']}' - "
    deadline = time.monotonic() + 10  # the serve process relays the run's output as it comes
    while not (said := [line for line in serve_log.read_text()[start:].splitlines() if named in line
                        and "training failed: ValueError: sample" in line]):
        assert time.monotonic() < deadline, serve_log.read_text()[start:][-3000:]
        time.sleep(0.2)
    shown = serve_log.read_text()[start:]
    assert len(said) == 1 and "Traceback" not in shown and "Root Cause" not in shown, shown[-3000:]
    assert said[0].split(named, 1)[1] == message.removeprefix("Flow run encountered an exception: TrainingFailed: ")


def test_a_value_out_of_its_bounds_is_refused_when_the_deployment_run_is_asked_for(served):
    """`-p epochs=0`: Prefect's API checks the deployment's parameter schema (bounds from the parameter's
    declaration) and creates no flow run."""
    env, api = served["env"], served["api"]
    before = len(_flow_runs(api, "train-pipeline/ddp"))
    out = _prefect(["deployment", "run", "train-pipeline/ddp", "-p", "epochs=0", "--watch"], dict(env, COLUMNS="1000"))
    assert out.returncode != 0 and "'epochs'" in out.stdout and "less than the minimum of 1" in out.stdout, out.stdout
    assert len(_flow_runs(api, "train-pipeline/ddp")) == before


TINY_SCRIPT = """\
import os, sys, mlflow, torch, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 0:
    with mlflow.start_run():
        mlflow.log_metric("epochs", float(sys.argv[1]))
    torch.save(torch.nn.Linear(2, 2).state_dict(), os.path.join(os.environ["GPUFLOW_OUTPUT_DIR"], "w.pt"))
dist.destroy_process_group()
"""


def test_the_script_deployment_runs_an_allowed_script_and_refuses_one_outside(served, tmp_path):
    env, api, base = served["env"], served["api"], served["base"]
    (base / "tiny.py").write_text(TINY_SCRIPT)
    (tmp_path / "evil.py").write_text(TINY_SCRIPT)
    common = ["-p", "script_args=[\"2\"]", "-p", "gpus=cpu", "-p", "experiment=scripted", "--watch"]
    ok = _prefect(["deployment", "run", "train-script/default", "-p", "script=tiny.py", *common], env, timeout=300)
    assert ok.returncode == 0, ok.stdout[-3000:] + (base / "serve.log").read_text()[-3000:]
    client = _client(served)
    (run,) = client.search_runs([client.get_experiment_by_name("scripted").experiment_id])
    assert run.info.status == "FINISHED" and run.data.metrics["epochs"] == 2.0
    assert run.data.params["gpuflow.world_size"] == "2" and "w.pt" in run.data.tags["gpuflow.checkpoint"]
    out = _prefect(["deployment", "run", "train-script/default", "-p", f"script={tmp_path / 'evil.py'}", *common],
                   env, timeout=300)
    state = _api(api, f"/flow_runs/{_flow_run_id(out.stdout)}")["state"]
    assert state["type"] == "FAILED" and "is outside the folders" in state["message"], state
    # `**` also matches no folder, so `**/..` climbs one level per repeat: refused, whatever it matches
    climb = _prefect(["deployment", "run", "train-script/default", "-p", "script=tiny.py", "-p",
                      'collect=["**/../**/../**/../**/../etc/passwd"]', *common], env, timeout=300)
    state = _api(api, f"/flow_runs/{_flow_run_id(climb.stdout)}")["state"]
    assert state["type"] == "FAILED" and "stays inside it" in state["message"], state
    assert len(client.search_runs([client.get_experiment_by_name("scripted").experiment_id])) == 1


def test_the_sweep_deployment_runs_its_trials_side_by_side_under_the_hosts_one_device_slot(served):
    """`prefect deployment run 'sweep/default' -p space=... -p trials=...`: the served sweep holds the
    host's device slot once (limit 1), so its two trials still run at the same time."""
    env, base = served["env"], served["base"]
    (base / "space.yaml").write_text("lr: {type: float, low: 1.0e-3, high: 0.1, log: true}\n")
    out = _prefect(["deployment", "run", "sweep/default", "-p", f"space={base / 'space.yaml'}", "-p", "trials=2",
                    "-p", "parallel=2", "-p", "gpus=cpu", "-p", "epochs=1", "-p", "pruner=none", "-p",
                    "study=served-sweep", "-p", "experiment=swept", "-p", "registered_model=swept", "--watch"],
                   env, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + (base / "serve.log").read_text()[-3000:]
    client = _client(served)
    runs = client.search_runs([client.get_experiment_by_name("swept").experiment_id])
    assert len(runs) == 3 and all(r.info.status == "FINISHED" for r in runs)
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    trials = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(trials) == 2 and parent.data.tags["prefect.deployment"] == "default"
    first_end = min(r.info.end_time for r in trials)
    assert all(r.info.start_time < first_end for r in trials)  # side by side, not queued on the slot
    assert (base / "optuna.db").is_file()  # the study beside the tracking store, in serve's folder
    assert client.get_model_version_by_alias("swept", "champion").run_id in {r.info.run_id for r in trials}


def test_cancelling_a_served_run_stops_its_ranks_and_ends_its_run_killed(served):
    env, api, db = served["env"], served["api"], served["db"]
    run = _prefect(["deployment", "run", "train-pipeline/ddp", "-p", "epochs=50", "-p", "gpus=cpu",
                    "-p", "dataset=synthetic", "-p", "synthetic_size=60000", "-p", "experiment=cancelled"], env)
    assert run.returncode == 0, run.stdout + run.stderr
    flow_run_id = _flow_run_id(run.stdout)
    deadline = time.monotonic() + 300
    while True:  # training has started: its first epoch is in MLflow
        try:
            with sqlite3.connect(db, timeout=5) as c:
                if c.execute("select 1 from metrics m join runs r on m.run_uuid = r.run_uuid join tags t on "
                             "t.run_uuid = r.run_uuid where m.key='train_loss' and t.key='prefect.flow_run_id' "
                             "and t.value=?", (flow_run_id,)).fetchone():
                    break
        except sqlite3.OperationalError:
            pass
        assert time.monotonic() < deadline, (served["base"] / "serve.log").read_text()[-3000:]
        time.sleep(1)
    launched = [p for p in psutil.process_iter(["cmdline"]) if "gpuflow.training" in (p.info["cmdline"] or [])
                and str(served["base"]) in " ".join(p.info["cmdline"])]
    assert len(launched) == 4  # the reaper, torchrun's agent and two ranks
    cancel = _prefect(["flow-run", "cancel", flow_run_id], env)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    deadline = time.monotonic() + HANG_GUARD_S
    while _api(api, f"/flow_runs/{flow_run_id}")["state_type"] != "CANCELLED":
        assert time.monotonic() < deadline, _api(api, f"/flow_runs/{flow_run_id}")["state"]
        time.sleep(1)
    _, alive = psutil.wait_procs(launched, timeout=60)
    assert not alive
    client = _client(served)
    (mine,) = client.search_runs([client.get_experiment_by_name("cancelled").experiment_id])
    assert mine.info.status == "KILLED" and "stopped by SIGTERM" in mine.data.tags["error"]


def test_the_nightly_retrain_is_fired_by_the_servers_scheduler_and_leaves_its_mlflow_run(served):
    api = served["api"]
    wait = (served["fire"] - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
    deadline = time.monotonic() + max(0.0, wait) + 300
    while True:
        runs = [r for r in _flow_runs(api, "retrain/nightly") if r["auto_scheduled"]]
        done = [r for r in runs if r["state_type"] in ("COMPLETED", "FAILED", "CRASHED")]
        if done:
            break
        assert time.monotonic() < deadline, (runs, (served["base"] / "serve.log").read_text()[-3000:])
        time.sleep(3)
    assert [r["state_type"] for r in done] == ["COMPLETED"], (served["base"] / "serve.log").read_text()[-3000:]
    client = _client(served)
    trained = client.search_runs([client.get_experiment_by_name("gpuflow").experiment_id])
    assert [r.info.status for r in trained] == ["FINISHED"]
    assert trained[0].data.tags["retrain.decision"] == "promoted"
    assert trained[0].data.tags["mlflow.source.name"] == "deployment retrain/nightly"  # the deployment it ran under
    flow_run = _api(api, f"/flow_runs/{trained[0].data.tags['prefect.flow_run_id']}")
    assert flow_run["name"] == trained[0].info.run_name == trained[0].data.tags["prefect.flow_run_name"]
    assert client.get_model_version_by_alias("gpuflow-model", "champion")


def test_ctrl_c_stops_make_serve_piped_through_tee_without_hanging(served, tmp_path):
    """`make serve 2>&1 | tee serve.log` in a terminal: Ctrl-C reaches make, gpuflow and tee at once,
    and gpuflow's output pipe closes under it as it shuts down."""
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(["bash", "-c", f"make -s serve 2>&1 | tee {log}"], cwd=ROOT, env=served["env"],
                            stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while "being served" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(HANG_GUARD_S)  # the shell ends when make (which waits for gpuflow) and tee have
        except subprocess.TimeoutExpired:
            raise AssertionError(subprocess.run(["ps", "-o", "pid,stat,cmd", "-g", str(proc.pid)],
                                                capture_output=True, text=True).stdout) from None
        assert subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).returncode == 1  # nothing left
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_ctrl_c_stops_gpuflow_serve_at_once_whose_pipe_reader_it_also_stopped(served, tmp_path):
    """`gpuflow serve 2>&1 | tee serve.log`, Ctrl-C: tee is gone before serve's shutdown writes its lines
    (EPIPE), and serve still shuts down as it does on a terminal, at the first Ctrl-C, exit status 0."""
    log, status = tmp_path / "serve.log", tmp_path / "status"
    proc = subprocess.Popen(["bash", "-c", f"{BIN / 'gpuflow'} serve 2>&1 | tee {log}; echo ${{PIPESTATUS[0]}} > {status}"],
                            cwd=served["base"], env=served["env"], stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while "being served" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: to serve and tee at once
        try:
            proc.wait(HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(subprocess.run(["ps", "-o", "pid,stat,cmd", "-g", str(proc.pid)],
                                                capture_output=True, text=True).stdout) from None
        assert status.read_text().strip() == "0", log.read_text()[-3000:]  # 1: rich's SystemExit on the dead pipe
        assert subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).returncode == 1  # nothing left
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_ctrl_c_stops_make_serve_promptly(served):
    proc = served["serving"].proc
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends to the foreground job
    assert proc.wait(HANG_GUARD_S) is not None
    assert "shutting down" in Path(served["base"] / "serve.log").read_text()
