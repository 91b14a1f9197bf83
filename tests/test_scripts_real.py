"""What a script's run does not show by itself: a script that is not distributed, run in several
processes (stopped at its first optimizer step; one that steps by hand is named when it ends), and
collected files that predate the run (an earlier run's snapshot, resumed from and logged as this run's).

The scripts are tiny and run by `gpuflow run --script` with 2 gloo processes, as in tests/test_scripts.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from gpuflow.training.compat import FRESH_RDZV_STORE
from gpuflow.training.contract import read_process_group
from tests.helpers import ROOT, TORCHRUN_LOGS
from tests.test_scripts import api_url, client, project, run_script  # noqa: F401  (api_url: a fixture)
from tests.test_user_code import gpuflow

# A single-process script, as tutorials write it: resumes from snapshot.pt when it exists and
# saves model.pt (atomically: under several processes both write it). `--by-hand`: no torch.optim step.
SOLO = """
    import os, sys, time, torch
    from mynet import SimpleNN, data

    time.sleep(float(sys.argv[1]))
    torch.manual_seed(0)
    model = SimpleNN()
    if os.path.exists("snapshot.pt"):
        model.load_state_dict(torch.load("snapshot.pt", weights_only=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = data().tensors
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if sys.argv[2:] == ["--by-hand"]:
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.05 * p.grad
        else:
            opt.step()
    torch.save(model.state_dict(), f".model.{os.getpid()}.tmp")
    os.replace(f".model.{os.getpid()}.tmp", "model.pt")
"""

# A DDP script that prepares its data (argv[1] seconds) before it joins the process group.
DDP = """
    import sys, time, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from mynet import SimpleNN, data

    time.sleep(float(sys.argv[1]))
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(SimpleNN())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = data().tensors
    for step in range(3):
        opt.zero_grad()
        part = slice(dist.get_rank(), None, dist.get_world_size())
        torch.nn.functional.cross_entropy(model(x[part]), y[part]).backward()
        opt.step()
    if dist.get_rank() == 0:
        torch.save(model.module.state_dict(), "model.pt")
    dist.barrier()  # leave together, the reducer freed first: gloo's teardown can abort a rank otherwise
    del model, opt
    dist.destroy_process_group()
"""

FIX = "run it with --strategy single (one process)"


def run(folder, api: str, script: str, *args: str, extra: tuple[str, ...] = (), code: int = 0
        ) -> tuple[dict, str]:
    """(the run's tags, the console) of `gpuflow run --script` with 2 processes."""
    out = gpuflow(["run", "--script", f"{script}.py", "--cpu-processes", "2", "--tracking-uri",
                   f"sqlite:///{folder / 'mlflow.db'}", "--collect", '["*.pt"]', *args, "--", *extra], folder, api)
    assert out.returncode == code, out.stdout[-3000:] + out.stderr[-3000:]
    if code:
        (found,) = client(folder).search_runs([client(folder).get_experiment_by_name("gpuflow").experiment_id])
        return found.data.tags | {"run_id": found.info.run_id, "status": found.info.status}, out.stdout + out.stderr
    run_id = out.stdout[out.stdout.index('"run_id": "') + 11:].split('"')[0]
    return client(folder).get_run(run_id).data.tags | {"run_id": run_id}, out.stdout + out.stderr


def collected(folder, run_id: str) -> set[str]:
    return {a.path for a in client(folder).list_artifacts(run_id, "collected")}


def test_a_script_that_trains_in_two_processes_without_a_group_is_stopped_at_its_first_step(
        tmp_path, api_url):  # noqa: F811
    folder = project(tmp_path / "proj", solo=SOLO)
    tags, console = run(folder, api_url, "solo", extra=("2",), code=1)  # 2 s of data preparation first
    last = console.strip().splitlines()[-1]
    assert last.startswith("gpuflow run: solo.py failed: NotDistributed: solo.py began to train in 2 processes "
                           "without a process group") and FIX in last
    assert re.search(r"solo\.py, line 20; rank [01]\)$", last), last
    assert tags["status"] == "FAILED" and not (folder / "model.pt").exists()  # stopped before its copies saved
    assert "not run again: NotDistributed" in console, console[-4000:]  # torchrun's restart trains nothing


def test_a_script_that_never_joins_a_process_group_is_named_with_the_fix_and_so_are_older_collected_files(
        tmp_path, api_url):  # noqa: F811
    folder = project(tmp_path / "proj", solo=SOLO)
    torch.save(torch.nn.Linear(1, 1).state_dict(), folder / "stale.pt")  # minutes before the launch
    snapshot = subprocess.run([sys.executable, "-c", "import torch; from mynet import SimpleNN; "
                               "torch.save(SimpleNN().state_dict(), 'snapshot.pt')"], cwd=folder)
    assert snapshot.returncode == 0
    os.utime(folder / "snapshot.pt", (1_700_000_000, 1_700_000_000))  # an earlier run's, resumed from

    tags, console = run(folder, api_url, "solo", extra=("0", "--by-hand"))  # no optimizer step to stop it at
    message = tags["gpuflow.not_distributed"]
    assert message.startswith("solo.py ran in 2 processes that never joined a process group: each trained a full "
                              "copy of the model") and FIX in message, message
    assert console.count(message) == 1, console[-4000:]  # the flow's line, after the script ended
    older = tags["gpuflow.predates_run"]
    assert "snapshot.pt (written 2023-11-1" in older and "stale.pt" in older and "model.pt" not in older, older
    assert "logged with the run all the same" in older and "collected files older than this run" in console
    assert collected(folder, tags["run_id"]) == {"collected/model.pt", "collected/snapshot.pt", "collected/stale.pt"}

    tags, console = run(folder, api_url, "solo", "--strategy", "single", extra=("0",))  # one process: the fix
    assert "gpuflow.not_distributed" not in tags and "process group" not in console, console[-4000:]
    older = tags["gpuflow.predates_run"]
    assert "snapshot.pt" in older and "model.pt" not in older, older  # model.pt is older, but written again


def test_a_ddp_script_is_not_flagged_however_long_it_prepares_before_it_joins(tmp_path, api_url):  # noqa: F811
    folder = project(tmp_path / "proj", train=DDP)
    tags, console = run(folder, api_url, "train", extra=("2",))
    assert "gpuflow.not_distributed" not in tags and "gpuflow.predates_run" not in tags, tags
    assert "process group" not in console, console[-4000:]
    assert collected(folder, tags["run_id"]) == {"collected/model.pt"}


# A DDP script that ran to its end, then each rank dies as it exits on the first attempt (as gloo's exit abort,
# pytorch#190489, kills a finished rank): torchrun restarts the group.
ABORTS_AT_EXIT = """
    import atexit, os, torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    dist.destroy_process_group()
    with open(f"ran-{os.environ['RANK']}.txt", "a") as f:
        f.write(os.environ["TORCHELASTIC_RESTART_COUNT"] + "\\n")
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        atexit.register(os.abort)
"""


def test_a_script_whose_ranks_all_finished_is_not_run_again_when_they_die_at_exit(tmp_path, api_url):  # noqa: F811
    folder = project(tmp_path / "proj", aborts=ABORTS_AT_EXIT)
    tags, console = run(folder, api_url, "aborts")
    assert [(folder / f"ran-{r}.txt").read_text() for r in (0, 1)] == ["0\n", "0\n"]  # once each, not twice
    assert console.count("not run again: every rank ran the script to its end") == 2, console[-4000:]
    assert client(folder).get_run(tags["run_id"]).info.status == "FINISHED"


def test_a_script_whose_ranks_all_finished_stands_when_they_die_at_exit_with_no_restart_left(
        tmp_path, api_url):  # noqa: F811
    folder = project(tmp_path / "proj", aborts=ABORTS_AT_EXIT)
    tags, console = run(folder, api_url, "aborts", "--max-restarts", "0")
    assert [(folder / f"ran-{r}.txt").read_text() for r in (0, 1)] == ["0\n", "0\n"]
    assert "every rank ran the script to its end, then a process failed as it exited" in console, console[-4000:]
    assert client(folder).get_run(tags["run_id"]).info.status == "FINISHED"


@pytest.mark.parametrize("script, nproc, joined", [("solo", 2, False), ("train", 2, True), ("solo", 1, None)])
def test_rank_0_records_whether_the_script_joined_a_process_group(tmp_path, script, nproc, joined):
    """gpuflow's runner under plain torchrun: the record the flow reads (none for one process)."""
    folder = project(tmp_path / "proj", solo=SOLO, train=DDP)
    record = tmp_path / "process_group.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "GPUFLOW_"))}
    # --max-restarts 1: gloo can abort a rank as it exits (CI9); the restarted attempt writes the record again
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--max-restarts=1", f"--log-dir={TORCHRUN_LOGS}", "-m", "gpuflow.training.runscript", f"{script}.py", "0",
           "--by-hand"]
    # the restart's rendezvous as gpuflow's launches make it (pytorch#167288: else "Connection refused" in gloo)
    out = subprocess.run(cmd, cwd=folder, env=env | FRESH_RDZV_STORE | {"GPUFLOW_PROCESS_GROUP_FILE": str(record)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    expected = None if joined is None else {"script": f"{script}.py", "world_size": nproc, "joined": joined}
    assert read_process_group(record) == expected
    assert "NotDistributed" not in out.stderr  # a DDP script steps inside its group


def test_the_shipped_ddp_tutorial_script_runs_as_the_docs_say_and_its_snapshot_is_the_checkpoint(
        tmp_path, api_url):  # noqa: F811
    """docs/scripts.md's command, on the example that ships (examples/train_ddp.py), run twice:
    the second run resumes from the snapshot the first left, as the tutorial's script does. Without
    --collect, the snapshot it wrote during the run is found and said; an older .pt file is not."""
    folder = project(tmp_path / "proj", train_ddp=(ROOT / "examples" / "train_ddp.py").read_text())
    torch.save(torch.nn.Linear(1, 1).state_dict(), folder / "old.pt")  # before the run: not the run's
    out = gpuflow(["run", "--script", "train_ddp.py", "--cpu-processes", "2", "--tracking-uri",
                   f"sqlite:///{folder / 'mlflow.db'}", "--", "--epochs", "2"], folder, api_url)
    assert out.returncode == 0, out.stderr[-3000:]
    first = json.loads(out.stdout[out.stdout.index("{"):])
    assert "collecting snapshot.pt: written by the script" in out.stderr, out.stderr[-3000:]
    assert collected(folder, first["run_id"]) == {"collected/snapshot.pt"}
    again = run_script(folder, "train_ddp", api_url, "--collect", '["snapshot.pt"]', extra=("--epochs", "3"))
    c = client(folder)
    assert [m.step for m in c.get_metric_history(first["run_id"], "train_loss")] == [1, 2]
    assert [m.step for m in c.get_metric_history(again["run_id"], "train_loss")] == [3]
    assert "Resuming training from snapshot at Epoch 2" in (folder / "runs" / again["run_id"] / "logs" / "script.log").read_text()
    assert "state dict at ['MODEL_STATE']" in c.get_run(first["run_id"]).data.tags["gpuflow.checkpoint"]
    torch.nn.Linear(20, 1).load_state_dict(torch.load(again["checkpoint"], weights_only=True)["model"], strict=True)
