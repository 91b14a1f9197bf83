"""This host's device slot (a Prefect global concurrency limit, as `gpuflow serve` makes it) on a
real Prefect server: a holder killed with SIGKILL frees it for the next run within seconds, served
or through a `gpuflow run`'s temporary API on the same PREFECT_HOME, and a `gpuflow run` waiting
for it stops on SIGTERM with its temporary API."""

from __future__ import annotations

import fcntl
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from gpuflow.flows.api import server_environment
from gpuflow.tasks.devices.cards import lock_dir
from gpuflow.tasks.devices.slot import DEVICE_LIMIT
from tests.helpers import ROOT, child_env
from tests.servers import prefect_server

FREED_WITHIN_S = 30  # far below the lease of a holder that stops renewing it
STOPPED_WITHIN_S = 60
START_S = 240  # a temporary API's start on a busy machine

HOLD = """
import time
from gpuflow.tasks.devices.slot import device_slot
with device_slot():
    print("held", flush=True)
    time.sleep(900)
"""

HOLD_WITH_NO_FILE = """
import socket, time
from prefect.client.orchestration import get_client
from gpuflow.tasks.devices.slot import DEVICE_LIMIT, _take_slot
with get_client(sync_client=True) as client:
    print("held", _take_slot(client, DEVICE_LIMIT.format(host=socket.gethostname())), flush=True)
    time.sleep(900)
"""

TAKE = """
from gpuflow.flows.api import prefect_api
from gpuflow.tasks.devices.slot import device_slot
with prefect_api():
    print("asking", flush=True)
    with device_slot():
        print("taken", flush=True)
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A Prefect server on its own PREFECT_HOME, started as gpuflow starts one, with the device limit."""
    home = tmp_path_factory.mktemp("slots") / "prefect-home"
    home.mkdir()
    proc, api = prefect_server(home, server_environment())
    with proc:
        _post(api, "/v2/concurrency_limits/", {"name": DEVICE_LIMIT.format(host=socket.gethostname()), "limit": 1})
        yield {"api": api, "home": home}


def _post(api: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(api + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or "{}")  # 204: no body


def _env(server, served: bool = True) -> dict:
    """A served run's environment (the server's URL), else a `gpuflow run`'s (its own API on the home)."""
    env = child_env(PREFECT_HOME=str(server["home"]))
    env.pop("PREFECT_API_URL", None)
    return {**env, "PREFECT_API_URL": server["api"]} if served else env


def _start(code: str, env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for(proc: subprocess.Popen, log: Path, line: str, timeout: float) -> float:
    """Seconds until `line` appears in the process's output; fails if it exits or is late."""
    start = time.monotonic()
    while line not in log.read_text():
        assert proc.poll() is None, f"exited {proc.returncode} before {line!r}:\n{log.read_text()[-3000:]}{_locks()}"
        assert time.monotonic() - start < timeout, \
            f"no {line!r} within {timeout} s:\n{log.read_text()[-3000:]}{_locks()}"
        time.sleep(0.2)
    return time.monotonic() - start


def _locks() -> str:
    """What the lock folder holds when a test fails: each entry, whether a process locks it, who wrote it."""
    folder, lines = lock_dir(), []
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        if not path.is_file():
            continue
        with open(path, "rb") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                state = "unlocked"
            except BlockingIOError:
                state = "locked"
            lines.append(f"{path.name} ({state}): {f.read(200).decode(errors='replace')}")
    return f"\nthe lock folder {folder}:\n" + ("\n".join(lines) or "(empty)")


@pytest.fixture
def holder(server, tmp_path):
    """A served run's process holding the slot; killed at the end if the test did not."""
    log = tmp_path / "holder.log"
    proc = _start(HOLD, _env(server), log)
    try:
        _wait_for(proc, log, "held", START_S)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _take_after_killing(holder: subprocess.Popen, env: dict, log: Path) -> float:
    """Seconds from the SIGKILL of the holder to a waiting taker having the slot."""
    taker = _start(TAKE, env, log)
    try:
        _wait_for(taker, log, "asking", START_S)
        _wait_for(taker, log, "waiting for this host's device slot", 30)
        holder.kill()
        return _wait_for(taker, log, "taken", FREED_WITHIN_S)
    finally:
        _end(taker, log)


def _end(taker: subprocess.Popen, log: Path) -> None:
    """A taker with the slot gives it back as it exits (killed mid-way, its lease would outlive the test); one
    still waiting is killed."""
    try:
        taker.wait(30 if "taken" in log.read_text() else 0)
    except subprocess.TimeoutExpired:
        taker.kill()
        taker.wait()


def test_a_slot_whose_served_holder_is_killed_goes_to_the_next_served_run_within_seconds(server, holder, tmp_path):
    _take_after_killing(holder, _env(server), tmp_path / "taker.log")


def test_a_slot_whose_served_holder_is_killed_goes_to_a_gpuflow_run_on_its_own_api_within_seconds(
        server, holder, tmp_path):
    _take_after_killing(holder, _env(server, served=False), tmp_path / "taker.log")


def test_sigterm_stops_a_gpuflow_run_waiting_for_the_slot_and_its_temporary_api(server, holder, tmp_path):
    log = tmp_path / "run.log"
    cmd = [sys.executable, "-m", "gpuflow.flows", "run", "--dataset", "synthetic", "--epochs", "1", "--gpus", "cpu",
           "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "--runs-dir", str(tmp_path / "runs")]
    run = subprocess.Popen(cmd, cwd=tmp_path, env=_env(server, served=False), stdout=subprocess.DEVNULL,
                           stderr=open(log, "w"), start_new_session=True)
    tree = [psutil.Process(run.pid)]
    try:
        _wait_for(run, log, "waiting for this host's device slot", START_S)
        assert f"pid {holder.pid} of" in log.read_text()  # who holds it
        tree += psutil.Process(run.pid).children(recursive=True)
        assert any(p.cmdline()[1:4] == ["-m", "prefect", "server"] for p in tree), tree  # its temporary API
        run.send_signal(signal.SIGTERM)
        try:
            assert run.wait(STOPPED_WITHIN_S) == 128 + signal.SIGTERM, log.read_text()[-3000:]
        except subprocess.TimeoutExpired:
            pytest.fail(f"still waiting {STOPPED_WITHIN_S} s after SIGTERM:\n{log.read_text()[-3000:]}")
        _, alive = psutil.wait_procs(tree[1:], timeout=STOPPED_WITHIN_S)
        assert not alive, f"left running: {alive}"
    finally:
        for p in tree:
            if p.is_running():
                p.kill()
        run.wait()


def test_a_slot_held_with_no_holder_file_is_waited_for_with_the_reasons_named_until_its_lease_is_released(
        server, tmp_path):
    """A lease no file here names (another TMPDIR's run, or one killed as it gave the slot back): the waiting run
    says what it may be and takes the slot once the lease goes."""
    holder_log, log = tmp_path / "holder.log", tmp_path / "taker.log"
    holder = _start(HOLD_WITH_NO_FILE, _env(server), holder_log)
    taker = None
    try:
        _wait_for(holder, holder_log, "held", START_S)
        lease = holder_log.read_text().split()[-1]
        taker = _start(TAKE, _env(server), log)
        _wait_for(taker, log, "waiting for this host's device slot", START_S)
        assert f"no holder file in {lock_dir()} (one whose GPUFLOW_LOCK_DIR or TMPDIR differs" in log.read_text()
        assert "lease lapses within 60 s" in log.read_text(), log.read_text()
        _post(server["api"], "/v2/concurrency_limits/decrement-with-lease", {"lease_id": lease})
        _wait_for(taker, log, "taken", FREED_WITHIN_S)
    finally:
        holder.kill()
        holder.wait()
        if taker is not None:
            _end(taker, log)
