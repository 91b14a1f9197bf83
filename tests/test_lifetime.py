"""No process a run starts outlives it (gpuflow/training/reaper.py), counted with real
processes: a user's script whose ranks ignore SIGTERM or start children of their own, the
flow killed outright, and `gpuflow server` stopped. Every process of a run is found by the
output folder gpuflow gives it (GPUFLOW_OUTPUT_DIR, in the environment it inherits)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from gpuflow.tasks.tracking.store import open_store  # under gpuflow's lock: a run may be creating the file
from tests.servers import free_port
from tests.test_user_code import api_url  # noqa: F401  (the session's Prefect server)

HANG_GUARD_S = 120
GRACE_S = "3"  # GPUFLOW_STOP_GRACE_S in these tests: SIGTERM, 3 s, then SIGKILL

# Ranks that ignore SIGTERM and never ask for a parent-death signal, as user code may.
STUBBORN = """
    import signal, time, torch.distributed as dist
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dist.init_process_group("gloo")
    print("ranks up", flush=True)
    time.sleep(1000)
"""

# Each rank starts a child of its own and exits 0.
SPAWNING = """
    import subprocess, torch.distributed as dist
    dist.init_process_group("gloo")
    subprocess.Popen(["sleep", "1000"])
    dist.barrier()
    dist.destroy_process_group()
"""


def of_run(folder: Path) -> list[psutil.Process]:
    """The live processes whose environment says they belong to a run in `folder`."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and \
                    p.environ().get("GPUFLOW_OUTPUT_DIR", "").startswith(str(folder)):
                found.append(p)
        except psutil.Error:
            pass
    return found


def gone(folder: Path, timeout: float = HANG_GUARD_S) -> list[str]:
    """Wait for every process of the run to end; what is still alive after `timeout`."""
    deadline = time.monotonic() + timeout
    while (left := of_run(folder)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [" ".join(p.cmdline()[:4]) for p in left]


def start_script(folder: Path, name: str, code: str, api: str) -> subprocess.Popen:
    (folder / f"{name}.py").write_text(textwrap.dedent(code))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_API"))}
    env |= {"PREFECT_API_URL": api, "GPUFLOW_STOP_GRACE_S": GRACE_S, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "gpuflow.flows", "run", "--script", f"{name}.py", "--gpus", "cpu",
                             "--cpu-processes", "2", "--max-restarts", "0"], cwd=folder, env=env,
                            stdout=subprocess.PIPE, stderr=open(folder / "err.log", "w"), text=True)


def wait_for_ranks(proc: subprocess.Popen, folder: Path, name: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while sum(f"{name}.py" in " ".join(p.cmdline()) for p in of_run(folder)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, (folder / "err.log").read_text()[-3000:]
        time.sleep(0.3)


def the_run(folder: Path):
    c = open_store(f"sqlite:///{folder / 'mlflow.db'}")
    (run,) = c.search_runs([c.get_experiment_by_name("gpuflow").experiment_id])
    return c, run


def test_kill_9_of_a_script_flow_takes_ranks_that_ignore_sigterm_with_it(tmp_path, api_url):
    proc = start_script(tmp_path, "stubborn", STUBBORN, api_url)
    try:
        wait_for_ranks(proc, tmp_path, "stubborn")
        watcher = [p for p in psutil.Process(proc.pid).children() if "gpuflow.tasks.tracking.watcher" in p.cmdline()]
        proc.kill()  # the flow dies outright: no finally, no hook of its own runs
        proc.wait()
        assert gone(tmp_path) == []
        _, alive = psutil.wait_procs(watcher, timeout=HANG_GUARD_S)  # it ends the run, then itself
        client, run = the_run(tmp_path)
        assert len(watcher) == 1 and not alive
        assert run.info.status == "KILLED" and "its watcher" in run.data.tags["error"]
    finally:
        for p in of_run(tmp_path):
            p.kill()


def test_sigterm_stops_a_script_whose_ranks_ignore_it_within_the_grace_period(tmp_path, api_url):
    proc = start_script(tmp_path, "stubborn", STUBBORN, api_url)
    try:
        wait_for_ranks(proc, tmp_path, "stubborn")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(HANG_GUARD_S) == 143, (tmp_path / "err.log").read_text()[-3000:]
        assert gone(tmp_path, timeout=5) == []  # the ranks were gone before gpuflow exited
        _, run = the_run(tmp_path)
        assert run.info.status == "KILLED"
    finally:
        for p in of_run(tmp_path):
            p.kill()


def test_children_a_script_leaves_behind_are_stopped_when_it_ends(tmp_path, api_url):
    proc = start_script(tmp_path, "spawning", SPAWNING, api_url)
    try:
        assert proc.wait(HANG_GUARD_S) == 0, (tmp_path / "err.log").read_text()[-3000:]
        assert gone(tmp_path, timeout=5) == []  # both `sleep 1000` stopped before gpuflow exited
        _, run = the_run(tmp_path)
        assert run.info.status == "FINISHED"
    finally:
        for p in of_run(tmp_path):
            p.kill()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_stopping_gpuflow_server_stops_the_prefect_server_it_started(tmp_path, sig):
    port = free_port()
    health = f"http://127.0.0.1:{port}/api/health"
    env = dict(os.environ, PREFECT_HOME=str(tmp_path), GPUFLOW_PREFECT_PORT=str(port), GPUFLOW_STOP_GRACE_S=GRACE_S)
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "gpuflow.flows", "server"], env=env, cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "err.log", "w"),
                            start_new_session=True)
    tree: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        while not _healthy(health):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "err.log").read_text()[-3000:]
            time.sleep(0.5)
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert any("prefect" in " ".join(p.cmdline()) for p in tree)
        proc.send_signal(sig)
        proc.wait(HANG_GUARD_S)
        _, alive = psutil.wait_procs(tree, timeout=HANG_GUARD_S)
        assert not alive, [p.cmdline()[:5] for p in alive]
        assert not _healthy(health)
    finally:
        for p in [psutil.Process(proc.pid), *tree] if proc.poll() is None else tree:
            try:
                p.kill()
            except psutil.Error:
                pass


def test_a_server_outlasting_the_stop_grace_goes_with_its_reaper(monkeypatch):
    """stop_supervised's grace (gpuflow stack: 30 s) shorter than the reaper's own (GPUFLOW_STOP_GRACE_S): the server
    that ignores SIGTERM is killed with its reaper, never left to init holding its port."""
    from gpuflow.training.reaper import start_supervised, stop_supervised

    monkeypatch.setenv("GPUFLOW_STOP_GRACE_S", "60")
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
            "time.sleep(300)")
    proc = start_supervised([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline() == "up\n"
    server = psutil.Process(proc.pid).children()
    assert len(server) == 1
    stop_supervised([proc], grace_s=1)
    _, alive = psutil.wait_procs(server, timeout=10)
    assert not alive
