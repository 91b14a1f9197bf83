"""This host's device slot (a Prefect global concurrency limit, as `gpuflow serve` makes it) on a
real Prefect server: a holder killed with SIGKILL frees it for the next run within seconds, a holder
renews its lease on the API that granted it (one its context names, not its environment), a
`gpuflow run` waiting for it stops on SIGTERM, and a `gpuflow run` on its temporary API shares
nothing with that server even on the same PREFECT_HOME."""

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

from gpuflow.flows.api import server_environment, template_path
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

# a served run's context, as `gpuflow serve` and `prefect_api()` make it: the API in the settings, not the environment
HOLD_IN_CONTEXT = """
import sys, time
from prefect.settings import PREFECT_API_URL, temporary_settings
from gpuflow.tasks.devices import slot
slot.RENEW_S = 1.0  # renewed every second, to see renewals within seconds (the lease: 60 s)
with temporary_settings(updates={PREFECT_API_URL: sys.argv[1]}), slot.device_slot():
    print("held", flush=True)
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


def test_a_gpuflow_run_on_its_temporary_api_shares_nothing_with_the_server_on_its_prefect_home(
        server, holder, tmp_path):
    """#58: the temporary API ran on the user's PREFECT_HOME database, saw a serve's device limit and queued a plain
    run behind served runs. Now it has a home of its own: the slot held on the server is not its business."""
    log = tmp_path / "taker.log"
    before = sorted(p.name for p in server["home"].iterdir())
    (tmp_path / "tmp").mkdir()
    taker = _start(TAKE, {**_env(server, served=False), "TMPDIR": str(tmp_path / "tmp")}, log)
    try:
        _wait_for(taker, log, "taken", START_S)
        assert taker.wait(60) == 0, log.read_text()[-3000:]
    finally:
        _end(taker, log)
    assert "waiting for this host's device slot" not in log.read_text()
    # the shared home got nothing of it but the empty database later temporary APIs start from
    assert sorted(p.name for p in server["home"].iterdir() if p.name != "gpuflow") == before
    assert [p.name for p in (server["home"] / "gpuflow").iterdir()] == [template_path().name]
    assert not list((tmp_path / "tmp").iterdir())  # its own home is gone with it


def test_a_holder_renews_its_lease_on_the_api_its_context_names(server, tmp_path):
    """#58: the renewal thread did not see the API of its flow's context (prefect_api(), gpuflow serve): Prefect
    started a server of its own for it, every renewal answered 410, and the slot was free after 60 s while the run
    still trained. The lease's expiry on the server moves on with each renewal, and no other server starts."""
    log = tmp_path / "holder.log"
    env = _env(server, served=False)  # no PREFECT_API_URL in the environment: only the context names the server
    holder = subprocess.Popen([sys.executable, "-c", HOLD_IN_CONTEXT, server["api"]], cwd=ROOT, env=env,
                              stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for(holder, log, "held", START_S)
        leases = server["home"] / "concurrency_leases"
        (lease,) = [p for p in leases.glob("*.json") if p.name != "expirations.json"]
        first = json.loads(lease.read_text())["expiration"]
        deadline = time.monotonic() + 60
        while json.loads(lease.read_text())["expiration"] == first:
            assert holder.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"the lease was not renewed within 60 s:\n{log.read_text()}"
            time.sleep(0.5)
        assert "Starting temporary server" not in log.read_text(), log.read_text()
        assert not [c for c in psutil.Process(holder.pid).children(recursive=True) if "prefect" in c.cmdline()]
    finally:
        holder.kill()
        holder.wait()
    _post(server["api"], "/v2/concurrency_limits/decrement-with-lease", {"lease_id": lease.stem})


def test_sigterm_stops_a_gpuflow_run_waiting_for_the_slot(server, holder, tmp_path):
    log = tmp_path / "run.log"
    cmd = [sys.executable, "-m", "gpuflow.flows", "run", "--dataset", "synthetic", "--epochs", "1", "--gpus", "cpu",
           "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "--runs-dir", str(tmp_path / "runs")]
    run = subprocess.Popen(cmd, cwd=tmp_path, env=_env(server), stdout=subprocess.DEVNULL,
                           stderr=open(log, "w"), start_new_session=True)
    tree = [psutil.Process(run.pid)]
    try:
        _wait_for(run, log, "waiting for this host's device slot", START_S)
        assert f"pid {holder.pid} of" in log.read_text()  # who holds it
        tree += psutil.Process(run.pid).children(recursive=True)
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
