"""Stopping a run from every direction, with real processes: Ctrl-C, SIGTERM to the flow or
to its whole process group, and kill -9. Each ends promptly (bench/ records how fast), with
the MLflow run KILLED and its reason, the Prefect flow run Crashed, no process of the run left,
the last checkpoint intact and no temp file; a killed flow takes its children with it."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlflow
import psutil
import pytest

from gpuflow.tasks.tracking import orphans
from gpuflow.training.checkpoint import load_file
from tests.helpers import ROOT, child_env

HANG_GUARD_S = 120  # a stop that takes longer is a hang; the goal (15 s) is checked in bench/


def start_pipeline(base: Path) -> tuple[subprocess.Popen, Path]:
    """`gpuflow run` on its defaults (temporary Prefect API), long enough to be stopped mid-way."""
    db = base / "mlflow.db"
    cmd = [sys.executable, "-m", "gpuflow.flows", "run", "--dataset", "synthetic", "--synthetic-size", "60000",
           "--epochs", "50", "--gpus", "cpu", "--tracking-uri", f"sqlite:///{db}", "--runs-dir", str(base / "runs")]
    env = child_env(PREFECT_HOME=str(base / "ph"))
    env.pop("PREFECT_API_URL", None)
    # its own group, as a shell gives a foreground job: a group signal reaches the flow only
    proc = subprocess.Popen(cmd, cwd=base, env=env, stdout=subprocess.DEVNULL, stderr=open(base / "err.log", "w"),
                            start_new_session=True)
    return proc, db


def wait_for_first_epoch(proc: subprocess.Popen, db: Path, base: Path) -> None:
    deadline = time.monotonic() + 300
    while True:
        try:
            with sqlite3.connect(db, timeout=5) as c:
                if c.execute("select 1 from metrics where key='train_loss'").fetchone():
                    return
        except sqlite3.OperationalError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, (base / "err.log").read_text()[-3000:]
        time.sleep(0.5)


def the_run(db: Path):
    runs = mlflow.MlflowClient(f"sqlite:///{db}").search_runs(
        [e.experiment_id for e in mlflow.MlflowClient(f"sqlite:///{db}").search_experiments()])
    assert len(runs) == 1
    return runs[0]


STOPS = {  # how, (signal, to the whole group?), exit code, the run's reason
    "ctrl-c": (signal.SIGINT, True, 130, "stopped by Ctrl-C (SIGINT) to the flow"),
    "sigterm": (signal.SIGTERM, False, 143, "stopped by SIGTERM to the flow"),
    "sigterm-group": (signal.SIGTERM, True, 143, "stopped by SIGTERM to the flow"),
}


@pytest.mark.parametrize("how", list(STOPS))
def test_a_stopped_run_ends_killed_with_its_reason_and_leaves_nothing_behind(how, tmp_path):
    sig, group, code, reason = STOPS[how]
    proc, db = start_pipeline(tmp_path)
    wait_for_first_epoch(proc, db, tmp_path)
    tree = [proc, *psutil.Process(proc.pid).children(recursive=True)]
    if how == "sigterm":  # the process tree of a default run, checked once: nothing the job does not need
        children = sorted(" ".join(p.cmdline()[1:3]) for p in psutil.Process(proc.pid).children())
        assert children == ["-m gpuflow.tasks.tracking.watcher", "-m gpuflow.training.reaper", "-m prefect"], children
        reaper = next(p for p in psutil.Process(proc.pid).children() if "gpuflow.training.reaper" in p.cmdline())
        (agent,) = reaper.children()
        assert "torch.distributed.run" in agent.cmdline()
        assert len(agent.children()) == 2 and len(tree) == 7
        assert all("gpuflow.training" in p.cmdline() for p in agent.children())
    (os.killpg if group else os.kill)(proc.pid, sig)
    assert proc.wait(HANG_GUARD_S) == code, (tmp_path / "err.log").read_text()[-3000:]
    _, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, [p.cmdline()[:4] for p in alive]
    run = the_run(db)
    assert run.info.status == "KILLED" and run.data.tags["error"].startswith(reason)
    assert "Finished in state Crashed" in (tmp_path / "err.log").read_text()  # not left Running in Prefect
    checkpoints = sorted((tmp_path / "runs" / run.info.run_id / "checkpoints").glob("epoch-*.pt"))
    assert checkpoints and load_file(checkpoints[-1])["epoch"] >= 1  # the last one is whole
    assert not list(tmp_path.rglob("*.tmp"))


def test_kill_9_of_the_flow_and_its_watcher_takes_its_api_torchrun_and_ranks_and_the_next_run_marks_it_killed(
        tmp_path):
    proc, db = start_pipeline(tmp_path)
    wait_for_first_epoch(proc, db, tmp_path)
    tree = psutil.Process(proc.pid).children(recursive=True)
    assert len(tree) == 6  # the API, the run's watcher, the reaper, torchrun and two ranks
    (watcher,) = [p for p in tree if "gpuflow.tasks.tracking.watcher" in p.cmdline()]
    watcher.kill()  # first, as a host crash would: it runs no more code (tests/test_killed_flow.py: its own part)
    proc.kill()
    proc.wait()
    _, alive = psutil.wait_procs(tree, timeout=HANG_GUARD_S)
    assert not alive, [p.cmdline()[:4] for p in alive]
    client = mlflow.MlflowClient(f"sqlite:///{db}")
    assert the_run(db).info.status == "RUNNING"  # nobody could end it...
    assert orphans.reap_orphaned_runs(client) == [the_run(db).info.run_id]  # ...until the next start
    assert the_run(db).info.status == "KILLED" and "killed or crashed" in the_run(db).data.tags["error"]


HOLDER = textwrap.dedent("""
    import json, sys, logging, time
    from pathlib import Path
    from gpuflow.tasks.devices.assign import DevicePlan
    from gpuflow.tasks.devices.cards import CardLocks
    from gpuflow.tasks.child import run_child
    plan = DevicePlan(strategy="single", backend="nccl", device="cuda", nproc_per_node=1, physical_ids=[0],
                      uuids=["GPU-fake-0"])
    locks = CardLocks(Path(sys.argv[1]))
    locks.acquire(plan)
    # a rank that takes 3 s to stop after SIGTERM, as one finishing a collective would
    slow = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: (time.sleep(3), sys.exit(0))); " \\
           "print('up', flush=True); time.sleep(600)"
    run_child([sys.executable, "-c", slow], None, Path.cwd(), logging.getLogger("x"), locks.fds)
""")


def test_card_lock_is_not_released_while_a_child_of_a_killed_flow_still_runs(tmp_path):
    from gpuflow.tasks.devices.cards import CardLocks

    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], cwd=ROOT, env=child_env())
    deadline = time.monotonic() + 60
    while len(psutil.Process(holder.pid).children()) < 1 or time.monotonic() < deadline - 55:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    child = psutil.Process(holder.pid).children()[0]
    probe = CardLocks(tmp_path)
    assert not probe.try_lock("GPU-fake-0")
    holder.kill()  # the flow dies outright; its child gets SIGTERM from the kernel
    holder.wait()
    while child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
        free = probe.try_lock("GPU-fake-0")
        if free:
            probe.release()
        assert not (free and child.is_running() and child.status() != psutil.STATUS_ZOMBIE), \
            "the card lock was free while the run's process still ran"
        time.sleep(0.1)
    deadline = time.monotonic() + 30
    while not probe.try_lock("GPU-fake-0"):  # and once it is gone, the card is free again
        assert time.monotonic() < deadline
        time.sleep(0.1)
    probe.release()
