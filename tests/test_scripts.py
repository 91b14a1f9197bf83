"""A user's own torchrun script under the train-script flow (gpuflow/flows/script.py).

The scripts are written here as users write them (the DDP tutorials' way: init_process_group,
DistributedSampler, torch.save of the DDP model's state_dict) and run by `gpuflow run
--script` from their own folder, against the session's Prefect server, with 2 gloo processes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlflow
import psutil
import pytest
import torch

from gpuflow.training.compat import FRESH_RDZV_STORE
from tests.helpers import TORCHRUN_LOGS
from tests.test_user_code import fresh_python, gpuflow

MYNET = """
    import torch
    from torch import nn

    class SimpleNN(nn.Module):
        def __init__(self, hidden=32):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(20, hidden), nn.Linear(hidden, 3)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    def data():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(512, 20, generator=g)
        return torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())
"""

# The seeds' script, unchanged: its own mlflow calls, a run name of its own, saves in its folder.
SEED_STYLE = """
    import argparse, mlflow, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler
    from mynet import SimpleNN, data

    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    a = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    ds = data()
    sampler = DistributedSampler(ds)
    loader = DataLoader(ds, batch_size=32, sampler=sampler)
    model = DDP(SimpleNN())
    opt = torch.optim.SGD(model.parameters(), lr=a.lr)
    if dist.get_rank() == 0:
        mlflow.start_run(run_name="my-own-name")
        mlflow.log_param("lr", a.lr)
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        if dist.get_rank() == 0:
            mlflow.log_metric("loss", loss.item(), step=epoch)
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), "model.pt")
        mlflow.end_run()
    dist.barrier()  # leave together: a gloo group torn down while a peer still works aborts it
    dist.destroy_process_group()
"""

# A snapshot dict of a compiled, DDP-wrapped model (keys `_orig_mod.module.`), in the output folder.
SNAPSHOT = """
    import os, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from mynet import SimpleNN, data

    dist.init_process_group("gloo")
    model = torch.compile(DDP(SimpleNN()), backend="eager")
    x, y = data().tensors
    loss = torch.nn.functional.cross_entropy(model(x[:8]), y[:8])
    loss.backward()
    if dist.get_rank() == 0:
        torch.save({"MODEL_STATE": model.state_dict(), "EPOCHS_RUN": 1},
                   os.path.join(os.environ["GPUFLOW_OUTPUT_DIR"], "snapshot.pt"))
    # leave together, the reducer freed first: a rank tearing gloo down while rank 0 still saves
    # aborted now and then (SIGABRT, 'terminate called without an active exception'), plain torchrun too
    dist.barrier()
    del model, loss
    dist.destroy_process_group()
"""

# The helper's way: declare, resume, report, save. KILL_AT="epoch,step" kills rank 1 there, once.
HELPER = """
    import os, signal, sys, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler
    from gpuflow.training import helper
    from mynet import SimpleNN, data

    epochs = int(sys.argv[1])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    ds = data()
    sampler = DistributedSampler(ds)
    loader = DataLoader(ds, batch_size=32, sampler=sampler)
    model = DDP(SimpleNN(hidden=16))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    helper.declare_model("mynet:SimpleNN", hidden=16, input_example=ds.tensors[0][:2])
    start = helper.resume(model, opt)
    kill = os.environ.get("KILL_AT")
    for epoch in range(start, epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2)
        for step, (x, y) in enumerate(loader, 1):
            if kill and [epoch + 1, step] == list(map(int, kill.split(","))) and dist.get_rank() == 1 \\
                    and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            total += torch.tensor([loss.item() * len(y), len(y)])
        dist.all_reduce(total)
        helper.report({"train_loss": total[0] / total[1]}, step=epoch + 1)
        helper.save_checkpoint(model, opt, epoch=epoch + 1)
        dist.barrier()
    dist.destroy_process_group()
"""

FAILING = """
    import torch.distributed as dist
    dist.init_process_group("gloo")
    raise ValueError("bad learning rate schedule: warmup longer than training")
"""


def project(folder: Path, **scripts: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "mynet.py").write_text(textwrap.dedent(MYNET))
    for name, code in scripts.items():
        (folder / f"{name}.py").write_text(textwrap.dedent(code))
    return folder


@pytest.fixture(scope="module")
def api_url(prefect_api):
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def run_script(folder: Path, script: str, api: str, *args: str, extra: tuple[str, ...] = (), **env) -> dict:
    out = gpuflow(["run", "--script", f"{script}.py", "--cpu-processes", "2", "--tracking-uri",
                   f"sqlite:///{folder / 'mlflow.db'}", *args, "--", *extra], folder, api, **env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout[out.stdout.index("{"):])


def client(folder: Path) -> mlflow.MlflowClient:
    return mlflow.MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")


def loads_strict(checkpoint: str, folder: Path, hidden: int = 32) -> None:
    out = fresh_python(f"""
        import torch
        from mynet import SimpleNN
        ck = torch.load({checkpoint!r}, weights_only=True)
        SimpleNN(hidden={hidden}).load_state_dict(ck["model"], strict=True)
        print("loaded")
    """, cwd=folder)
    assert "loaded" in out.stdout, out.stderr[-2000:]


def test_a_seed_style_script_runs_unchanged_in_one_run_with_its_own_metrics_and_a_clean_checkpoint(tmp_path, api_url):
    folder = project(tmp_path / "proj", train=SEED_STYLE)
    out = run_script(folder, "train", api_url, "--collect", '["model.pt"]', extra=("--epochs", "3"))
    c = client(folder)
    (run,) = c.search_runs([c.get_experiment_by_name("gpuflow").experiment_id])
    assert run.info.run_id == out["run_id"] and run.info.status == "FINISHED"
    assert run.info.run_name != "my-own-name" and re.fullmatch(r"train-[0-9a-f]{6}", run.info.run_name)
    assert run.data.params["lr"] == "0.05" and run.data.params["gpuflow.script_args"] == '["--epochs", "3"]'
    assert [m.step for m in c.get_metric_history(run.info.run_id, "loss")] == [0, 1, 2]  # the script's own
    assert out["checkpoint"] and "prefixes stripped" in run.data.tags["gpuflow.checkpoint"]
    assert torch.load(folder / "model.pt", weights_only=True).keys() >= {"module.fc1.weight"}
    loads_strict(out["checkpoint"], folder)
    artifacts = {a.path for a in c.list_artifacts(run.info.run_id, "collected")}
    assert artifacts == {"collected/model.pt"}
    assert out["model_version"] is None  # nothing declared: nothing registered


def test_a_nested_snapshot_of_a_compiled_ddp_model_is_found_and_de_prefixed(tmp_path, api_url):
    folder = project(tmp_path / "proj", snap=SNAPSHOT)
    out = run_script(folder, "snap", api_url, "--max-restarts", "0")
    raw = torch.load(Path(c_outputs(folder, out)) / "snapshot.pt", weights_only=True)
    assert next(iter(raw["MODEL_STATE"])).startswith("_orig_mod.module.")
    tag = client(folder).get_run(out["run_id"]).data.tags["gpuflow.checkpoint"]
    assert "state dict at ['MODEL_STATE']" in tag
    loads_strict(out["checkpoint"], folder)


def c_outputs(folder: Path, out: dict) -> Path:
    return folder / "runs" / out["run_id"] / "outputs"


def test_the_helper_reports_live_resumes_after_a_killed_rank_and_registers_the_model(tmp_path, api_url):
    folder = project(tmp_path / "proj", train=HELPER)
    killed = run_script(folder, "train", api_url, "--registered-model", "scripted", extra=("3",),
                        KILL_AT="2,3")
    straight = run_script(folder, "train", api_url, "--registered-model", "scripted", extra=("3",))
    c = client(folder)
    for out in (killed, straight):
        assert [m.step for m in c.get_metric_history(out["run_id"], "train_loss")] == [1, 2, 3]
    logs = folder / "runs" / killed["run_id"] / "logs"
    log = (logs / "script.log").read_text()
    assert "[rank1]:[rank 1] resumed from" in log and "epoch-0001.pt" in log, log[-3000:]  # tagged by rank
    (rank1,) = logs.glob("ranks/*/attempt_1/1/stdout.log")  # each rank's own log, per attempt
    assert "[rank 1] resumed from" in rank1.read_text()
    assert [a.path for a in c.list_artifacts(killed["run_id"], "logs")] == ["logs/ranks", "logs/script.log"]
    a = torch.load(killed["checkpoint"], weights_only=True)["model"]
    b = torch.load(straight["checkpoint"], weights_only=True)["model"]
    for k in b:
        assert torch.allclose(a[k], b[k], atol=1e-6), k
    assert killed["model_version"] == "1"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = fresh_python(f"""
        import mlflow, numpy as np
        mlflow.set_tracking_uri({f"sqlite:///{folder / 'mlflow.db'}"!r})
        m = mlflow.pyfunc.load_model("models:/scripted/1")
        print("shape", m.predict(np.zeros((4, 20), dtype=np.float32)).shape)
        print("signature", m.metadata.signature.inputs.to_dict())
    """, cwd=elsewhere)
    assert "shape (4, 3)" in out.stdout, out.stderr[-3000:]
    assert "'shape': (-1, 20)" in out.stdout, out.stdout  # from the example the script declared
    torch.save({"inputs": torch.zeros(4, 20)}, tmp_path / "x.pt")
    infer = gpuflow(["infer", "--registered-model", "scripted", "--version", "1", "--inputs", str(tmp_path / "x.pt"),
                     "--gpus", "cpu", "--tracking-uri", f"sqlite:///{folder / 'mlflow.db'}"], elsewhere, api_url)
    assert infer.returncode == 0, infer.stderr[-3000:]
    outputs = json.loads(infer.stdout[infer.stdout.index("{"):])["outputs"]
    assert torch.tensor(outputs).shape == (4, 3)


def test_bad_scripts_are_refused_or_fail_with_their_own_error(tmp_path, api_url):
    folder = project(tmp_path / "proj", boom=FAILING)
    cases = {("--script", "missing.py"): "no such file", ("--script", "mynet.py", "--collect", '"x"'): "JSON list"}
    for args, message in cases.items():
        out = gpuflow(["run", *args], folder, api_url)
        assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]
    out = gpuflow(["run", "--script", "boom.py", "--cpu-processes", "2", "--max-restarts", "1"], folder, api_url)
    cause = ("boom.py failed: ValueError: bad learning rate schedule: warmup longer than training "
             f"(at {folder / 'boom.py'}, line 4; rank ")
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1].startswith(f"gpuflow run: {cause}"), \
        out.stderr[-3000:]
    assert "not run again" in out.stderr  # failed before any progress: the restart does not run it again
    c = client(folder)
    (run,) = c.search_runs([c.get_experiment_by_name("gpuflow").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["error"].startswith(f"TrainingFailed: {cause}")


def test_sigterm_to_the_flow_ends_the_run_killed_and_stops_every_rank(tmp_path, api_url):
    folder = project(tmp_path / "proj", slow="import time, torch.distributed as dist\n"
                     "dist.init_process_group('gloo')\nprint('training', flush=True)\ntime.sleep(300)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_API"))}
    proc = subprocess.Popen([str(Path(sys.executable).parent / "gpuflow"), "run", "--script", "slow.py",
                             "--cpu-processes", "2"], cwd=folder, env=env | {"PREFECT_API_URL": api_url},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if "training" in line and "launching" not in line:
                break
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)]
        assert len(ranks) == 5, ranks  # the run's watcher, the reaper, torchrun's agent and two ranks
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) is not None
    finally:
        proc.kill()
    _, alive = psutil.wait_procs(ranks, timeout=30)
    assert not alive
    time.sleep(0.5)
    c = client(folder)
    (run,) = c.search_runs([c.get_experiment_by_name("gpuflow").experiment_id])
    assert run.info.status == "KILLED" and "SIGTERM" in run.data.tags["error"]


# word_language_model's way: arguments of every kind, the whole module saved; from scratch on a restart (its first
# attempt dies after reporting epoch 2), so epochs 1 and 2 are reported twice
RESTARTED = """
    import argparse, os, torch
    from gpuflow.training import helper
    from mynet import SimpleNN, data

    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--save", default="model.pt")
    p.add_argument("--tied", action="store_true")
    a = p.parse_args()
    torch.manual_seed(0)
    model = SimpleNN()
    opt = torch.optim.SGD(model.parameters(), lr=a.lr)
    x, y = data().tensors
    for epoch in range(1, 4):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        helper.report({"loss": loss.item()}, step=epoch)
        if epoch == 2 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            os._exit(3)
    with open(a.save, "wb") as f:
        torch.save(model, f)
"""


def test_a_restarted_script_logs_each_step_once_its_arguments_one_param_each_and_names_its_whole_model_checkpoint(
        tmp_path, api_url):
    folder = project(tmp_path / "proj", train=RESTARTED)
    done = gpuflow(["run", "--script", "train.py", "--strategy", "single", "--tracking-uri",
                    f"sqlite:///{folder / 'mlflow.db'}", "--", "data", "--lr", "0.05", "--tied"], folder, api_url)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout[done.stdout.index("{"):])
    c = client(folder)
    run = c.get_run(out["run_id"])
    assert [m.step for m in c.get_metric_history(out["run_id"], "loss")] == [1, 2, 3]  # 1 and 2 reported twice
    assert "reported again, not logged twice" in done.stderr and "loss at step 1, 2" in done.stderr
    params = run.data.params
    assert (params["args.0"], params["args.lr"], params["args.tied"]) == ("data", "0.05", "true")
    assert params["gpuflow.script_args"] == '["data", "--lr", "0.05", "--tied"]'
    assert out["checkpoint"] and Path(out["checkpoint"]).name == "model.pt"  # the logged one, kept with the run
    assert Path(out["checkpoint"]).read_bytes() == (folder / "model.pt").read_bytes()
    assert {a.path for a in c.list_artifacts(out["run_id"], "checkpoints")} == {"checkpoints/model.pt"}
    assert run.data.tags["gpuflow.checkpoint"].startswith("model.pt logged unchanged, not de-prefixed")


# --- the pieces, without a flow -----------------------------------------------------------


@pytest.mark.parametrize("wrap", ["module.", "_orig_mod.", "_orig_mod.module.", "module._orig_mod."])
def test_state_dicts_are_found_nested_and_stripped_of_every_wrapper_prefix(tmp_path, wrap):
    from gpuflow.training.statedict import extract_state_dict

    plain = torch.nn.Linear(3, 2).state_dict()
    path = tmp_path / "snap.pt"
    torch.save({"EPOCHS_RUN": 4, "MODEL_STATE": {wrap + k: v for k, v in plain.items()}, "note": "x"}, path)
    state, where = extract_state_dict(path)
    assert where == "['MODEL_STATE']" and list(state) == list(plain)
    torch.nn.Linear(3, 2).load_state_dict(state, strict=True)


def test_a_file_without_a_state_dict_is_refused_with_what_it_holds(tmp_path):
    from gpuflow.training.checkpoint import CheckpointError
    from gpuflow.training.statedict import extract_state_dict

    torch.save({"epoch": 3, "losses": [0.5, 0.4]}, tmp_path / "stats.pt")
    with pytest.raises(CheckpointError, match="holds no state dict.*found: epoch, losses"):
        extract_state_dict(tmp_path / "stats.pt")


def test_the_helper_under_plain_torchrun_only_writes_files(tmp_path):
    """No flow: checkpoints and metrics land in ./gpuflow-output; a rerun resumes after them."""
    folder = project(tmp_path / "proj", train=HELPER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "GPUFLOW_"))}
    # --max-restarts 1: gloo can abort a rank as it exits after the last barrier ("terminate called without an
    # active exception", seen once in a loaded full run); the restarted pair resumes after the last epoch, trains none
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           f"--log-dir={TORCHRUN_LOGS}", "train.py"]
    for epochs in ("1", "2"):
        out = subprocess.run([*cmd, epochs], cwd=folder, env=env | FRESH_RDZV_STORE, capture_output=True, text=True,
                             timeout=120)  # the restart's rendezvous as gpuflow's launches make it (pytorch#167288)
        assert out.returncode == 0, out.stderr[-3000:]
    made = folder / "gpuflow-output"
    assert sorted(p.name for p in (made / "checkpoints").iterdir()) == ["epoch-0001.pt", "epoch-0002.pt"]
    assert "resumed from" in out.stdout + out.stderr
    lines = [json.loads(line) for line in (made / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]  # rank 0 only, each epoch once
    assert json.loads((made / "model.json").read_text()) == {"reference": "mynet:SimpleNN", "kwargs": {"hidden": 16}}
    assert not (folder / "mlflow.db").exists() and not (folder / "mlruns").exists()


def test_the_helper_resumes_the_model_optimizer_and_random_streams(tmp_path, monkeypatch):
    """A resumed script draws the same dropout masks and shuffles as one that never stopped."""
    import random

    import numpy as np

    from gpuflow.training import helper

    monkeypatch.setenv("GPUFLOW_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.delenv("RANK", raising=False)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Dropout(0.5))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert helper.resume(model, opt) == 0  # nothing saved yet
    path = helper.save_checkpoint(model, opt, epoch=3)
    after = (torch.rand(3), np.random.rand(2), random.random(), model(torch.ones(1, 4)))

    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Dropout(0.5))
    fresh_opt = torch.optim.Adam(fresh.parameters())
    assert helper.resume(fresh, fresh_opt) == 3 and path.name == "epoch-0003.pt"
    again = (torch.rand(3), np.random.rand(2), random.random(), fresh(torch.ones(1, 4)))
    torch.testing.assert_close(again[0], after[0])
    assert np.array_equal(again[1], after[1]) and again[2] == after[2]
    torch.testing.assert_close(again[3], after[3])  # same weights, same dropout mask
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]


def test_the_helper_gives_a_scheduler_and_a_scaler_their_saved_state_back(tmp_path, monkeypatch):
    # save_checkpoint(**extra) stored what a scheduler or a scaler is, and resume() gave back the epoch alone: a
    # resumed script's learning rate schedule started over.
    from gpuflow.training import helper
    from gpuflow.training.checkpoint import CheckpointError

    monkeypatch.setenv("GPUFLOW_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.delenv("RANK", raising=False)

    def parts():
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), torch.amp.GradScaler("cpu")

    model, opt, sched, scaler = parts()
    for _ in range(3):
        opt.step()
        sched.step()
    scaler.scale(torch.tensor(1.0))
    scaler.update(2.0 ** 7)
    helper.save_checkpoint(model, opt, epoch=3, scheduler=sched, scaler=scaler, note="plain values stay as given")
    model, opt, sched, scaler = parts()
    assert helper.resume(model, opt, scheduler=sched, scaler=scaler) == 3
    assert sched.last_epoch == 3 and opt.param_groups[0]["lr"] == 0.125 and scaler.get_scale() == 2.0 ** 7
    with pytest.raises(CheckpointError, match="holds no warmup .*save_checkpoint\\(..., warmup=...\\)"):
        helper.resume(*parts()[:2], warmup=parts()[2])


ON_TWO_MACHINES = """\
import json, os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
os.environ["GPUFLOW_OUTPUT_DIR"] = os.path.join(sys.argv[1], f"machine{rank}")  # each rank its machine's folder
from gpuflow.training import helper
torch.manual_seed(rank)
model = torch.nn.Linear(3, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model(torch.ones(1, 3)).sum().backward()
opt.step()
if sys.argv[2] == "save":
    helper.save_checkpoint(model, opt, epoch=2)  # rank 0's alone
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(sys.argv[1], "saved.pt"))
else:
    epoch = helper.resume(model, opt)
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump({"epoch": epoch, "weight": model.weight.tolist()}, f)
dist.destroy_process_group()
"""


def test_the_helper_resumes_every_rank_from_rank_0s_checkpoint_when_each_machine_has_its_folder(tmp_path):
    # Only global rank 0 saves; a rank on another machine (its own output folder) found no checkpoint and started
    # at epoch 0 with its own weights while rank 0 resumed: the ranks ran out of step.
    (tmp_path / "train.py").write_text(ON_TWO_MACHINES)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "GPUFLOW_"))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--log-dir={TORCHRUN_LOGS}", "train.py", str(tmp_path)]
    for step in ("save", "resume"):
        out = subprocess.run([*cmd, step], cwd=tmp_path, env=env | FRESH_RDZV_STORE, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
    assert not (tmp_path / "machine1" / "checkpoints").exists()
    saved = torch.load(tmp_path / "saved.pt", weights_only=True)["weight"].tolist()
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"epoch": 2, "weight": saved}


ASYNC_LOGGER = """\
import os, mlflow, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 0:
    mlflow.start_run()
    for step in range(300):
        mlflow.log_metric("step_loss", 1.0 / (step + 1), step=step)  # queued: returns before the store answers
    with open(os.path.join(os.environ["GPUFLOW_OUTPUT_DIR"], "async.txt"), "w") as f:
        f.write(os.environ.get("MLFLOW_ENABLE_ASYNC_LOGGING", ""))
dist.destroy_process_group()  # no end_run: MLflow's exit hook sends what is still queued
"""


def test_a_scripts_own_metric_calls_do_not_wait_on_the_store_and_none_is_lost(tmp_path, api_url):
    folder = project(tmp_path / "proj", logger=ASYNC_LOGGER)
    out = run_script(folder, "logger", api_url)
    c = client(folder)
    assert [m.step for m in c.get_metric_history(out["run_id"], "step_loss")] == list(range(300))
    assert (folder / "runs" / out["run_id"] / "outputs" / "async.txt").read_text() == "true"
