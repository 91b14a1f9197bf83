"""Card locks with real processes: two unix users share them; every process that uses a card
(a training rank, an evaluation) holds it until it exits, a rank of a killed flow included;
`gpuflow infer` holds its card while its evaluation child runs. GPUs are faked: only the
locks are real."""

from __future__ import annotations

import fcntl
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from gpuflow.flows import infer
from gpuflow.flows.params import InferParams
from gpuflow.tasks.tracking import registry
from gpuflow.tasks.devices.cards import CardLocks
from gpuflow.tasks.devices.probe import EnvironmentReport, GpuInfo
from gpuflow.training import TrainConfig
from gpuflow.training.cardlock import CARD_LOCKS_ENV, hold_card_locks
from gpuflow.training.contract import CARD_OWNER_ENV as OWNER_ENV
from gpuflow.training.errors import UserError
from gpuflow.training.models import SimpleNN
from tests.helpers import ROOT, TORCHRUN_LOGS, child_env

UUID = "GPU-lock-test"
HANG_GUARD_S = 120  # longer is a hang, not slowness


def one_gpu_host() -> EnvironmentReport:
    card = GpuInfo(index=0, uuid=UUID, pci_bus_id="00000000:01:00.0", name="fake", memory_free_mb=80_000)
    return EnvironmentReport(hostname="fake", cpu_count=2, source="nvml", gpus=[card])


def made_card_files(folder: Path) -> CardLocks:
    """A run took the card once, so its lock files exist (as they do for a launched child)."""
    locks = CardLocks(folder, ranks_wait_s=0)
    assert locks.try_lock(UUID)
    locks.release()
    return locks


def waiting_on(path: Path) -> set[int]:
    """Pids blocked on a flock of `path`: /proc/locks lists each waiter after '->'."""
    ino = path.stat().st_ino
    fields = [line.split() for line in Path("/proc/locks").read_text().splitlines()]
    return {int(f[5]) for f in fields if len(f) > 6 and f[1] == "->" and int(f[6].rsplit(":", 1)[1]) == ino}


def wait_until(check, what: str):
    deadline = time.monotonic() + HANG_GUARD_S
    while not (found := check()):
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)
    return found


def held(path: Path) -> bool:
    """Whether some process holds a flock on `path` (probed, not kept)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


# --- two unix users ----------------------------------------------------------------------

DRIVER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from gpuflow.tasks.devices.cards import CardLocks
    locks = CardLocks(Path(sys.argv[1]), ranks_wait_s=0)
    for line in sys.stdin:
        cmd, _, uuid = line.strip().partition(" ")
        try:
            print(locks.try_lock(uuid) if cmd == "try" else locks.release(), flush=True)
        except Exception as e:
            print(f"{type(e).__name__}: {e}", flush=True)
""")


def python_as_nobody(home: Path) -> list[str] | None:
    """A command running Python with gpuflow importable as user nobody (this venv's interpreter
    may sit in root's home; then the system one of the same version loads the venv's packages)."""
    site_dir = sysconfig.get_paths()["purelib"]
    boot = f"import site, sys; sys.path.insert(0, {site_dir!r}); site.addsitedir({site_dir!r})\n"
    for exe in (sys.executable, f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"):
        cmd = ["runuser", "-u", "nobody", "--", "env", f"HOME={home}", f"PREFECT_HOME={home / 'prefect'}",
               exe, "-c", boot]
        probe = cmd[:-1] + [boot + "import gpuflow.tasks.devices.cards"]
        if shutil.which(exe) and subprocess.run(probe, capture_output=True, cwd=home).returncode == 0:
            return cmd
    return None


@pytest.fixture
def shared_tmp():
    """A folder under /tmp that user nobody can reach (pytest's tmp_path is root's alone)."""
    base = Path(tempfile.mkdtemp(prefix="gpuflow-two-users-", dir="/tmp"))
    base.chmod(0o777)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def test_a_second_unix_user_shares_the_card_locks_and_waits_for_the_first(shared_tmp):
    if os.geteuid() != 0 or not shutil.which("runuser"):
        pytest.skip("needs root and runuser to act as a second unix user")
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no 'nobody' account to act as the second unix user")
    python = python_as_nobody(shared_tmp)
    if python is None:
        pytest.skip("user nobody cannot run a Python that imports gpuflow here")
    folder, root = shared_tmp / "locks", CardLocks(shared_tmp / "locks", ranks_wait_s=0)
    old = os.umask(0o077)  # the modes must not depend on the creator's umask
    try:
        assert root.try_lock(UUID)
    finally:
        os.umask(old)
    assert folder.stat().st_mode & 0o7777 == 0o1777
    assert {p.stat().st_mode & 0o777 for p in folder.iterdir()} == {0o666}
    env = child_env()
    env.pop("GPUFLOW_LOCK_DIR", None)
    other = subprocess.Popen([*python[:-1], python[-1] + DRIVER, str(folder)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=open(shared_tmp / "err.log", "w"), text=True,
                             cwd=shared_tmp, env=env)

    def ask(line: str) -> str:
        other.stdin.write(line + "\n")
        other.stdin.flush()
        answer = other.stdout.readline().strip()
        assert answer, (shared_tmp / "err.log").read_text()[-2000:]
        return answer

    try:
        assert ask(f"try {UUID}") == "False"  # root holds it: nobody sees it held, without crashing
        root.release()
        assert ask(f"try {UUID}") == "True"  # free: nobody takes root's lock file
        assert not root.try_lock(UUID)  # and root now waits for nobody
        assert ask("release") == "None"
        assert ask("try GPU-made-by-nobody") == "True" and ask("release") == "None"
        assert root.try_lock("GPU-made-by-nobody")  # root uses nobody's files as well
        legacy = folder / "GPU-legacy.lock"
        legacy.touch(0o644)  # as gpuflow made them before: only root may write it
        assert ask("try GPU-legacy") == (f"CardLockError: card lock file {legacy} belongs to root with mode 644 "
                                         f"and this user cannot open it; have its owner run `chmod 666 {legacy}` "
                                         "(or remove it)")
    finally:
        root.release()
        other.stdin.close()
        other.wait(HANG_GUARD_S)


# --- the processes that use a card hold it -----------------------------------------------

HOLD = ("import time; from gpuflow.training.cardlock import hold_card_locks; "
        "print(len(hold_card_locks()), flush=True); time.sleep(600)")


def test_a_process_using_the_card_keeps_it_until_it_exits_and_a_new_run_waits_for_it(tmp_path, caplog):
    locks = made_card_files(tmp_path)
    user = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True,
                            env=child_env(**{CARD_LOCKS_ENV: str(locks.path(UUID, "ranks"))}))
    assert user.stdout.readline().strip() == "1"
    assert not locks.try_lock(UUID)  # no run holds the card, but a process still uses it
    assert locks.held_elsewhere(one_gpu_host()) == {0}
    waiter, got = CardLocks(tmp_path, ranks_wait_s=HANG_GUARD_S), []
    thread = threading.Thread(target=lambda: got.append(waiter.try_lock(UUID)))
    thread.start()
    wait_until(lambda: "waiting up to" in caplog.text, "the new run says what it waits for")
    user.kill()  # however the process ends, the kernel drops its lock
    user.wait()
    thread.join(HANG_GUARD_S)
    assert got == [True]  # the waiting run got the card once the process was gone
    waiter.release()


def test_the_worker_holds_nothing_without_the_variable_and_names_a_missing_lock_file(tmp_path):
    assert hold_card_locks({}) == []  # a worker started by hand or by a test
    with pytest.raises(UserError, match=f"{CARD_LOCKS_ENV} names {tmp_path / 'x.ranks'}, which does not exist"):
        hold_card_locks({CARD_LOCKS_ENV: str(tmp_path / "x.ranks")})


def test_a_training_rank_takes_the_card_before_it_reads_its_config(tmp_path):
    ranks = made_card_files(tmp_path).path(UUID, "ranks")
    blocker = os.open(ranks, os.O_RDONLY)
    fcntl.flock(blocker, fcntl.LOCK_EX)  # the rank must wait on it: the moment to look
    rank = subprocess.Popen([sys.executable, "-m", "gpuflow.training", "--config", str(tmp_path / "none.json")],
                            env=child_env(**{CARD_LOCKS_ENV: str(ranks)}), stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: rank.pid in waiting_on(ranks), "the rank asks for the card's lock")
    finally:
        os.close(blocker)
    _, err = rank.communicate(timeout=HANG_GUARD_S)
    assert rank.returncode == 2 and "none.json' does not exist" in err  # then it went on to its config


def test_a_rank_of_a_users_script_holds_its_card_until_it_exits(tmp_path):
    """docs/devices.md: every process on the card holds its lock, a script's ranks too, not only gpuflow's worker."""
    locks = made_card_files(tmp_path)
    (tmp_path / "train.py").write_text("print('training', flush=True)\nimport time\ntime.sleep(60)\n")
    rank = subprocess.Popen([sys.executable, "-m", "gpuflow.training.runscript", str(tmp_path / "train.py")],
                            env=child_env(**{CARD_LOCKS_ENV: str(locks.path(UUID, "ranks"))}), stdout=subprocess.PIPE,
                            text=True, cwd=tmp_path)
    try:
        assert rank.stdout.readline().strip() == "training"
        assert locks.held_elsewhere(one_gpu_host()) == {0}  # no run holds the card, but the script's rank uses it
    finally:
        rank.kill()
        rank.wait()
    assert CardLocks(tmp_path, ranks_wait_s=HANG_GUARD_S).held_elsewhere(one_gpu_host()) == set()
    missing = subprocess.run([sys.executable, "-m", "gpuflow.training.runscript", str(tmp_path / "train.py")],
                             env=child_env(**{CARD_LOCKS_ENV: str(tmp_path / "x.ranks")}), capture_output=True,
                             text=True, cwd=tmp_path, timeout=HANG_GUARD_S)
    assert missing.returncode == 2 and f"{CARD_LOCKS_ENV} names {tmp_path / 'x.ranks'}" in missing.stderr, \
        missing.stderr[-2000:]


RANK = textwrap.dedent("""
    import signal, sys, time
    from pathlib import Path
    from gpuflow.training.cardlock import hold_card_locks
    from gpuflow.training.lifetime import die_with_parent

    def leave(*_):  # a rank still finishing after its agent died: it leaves when the test says so
        while not Path(sys.argv[1], "release").exists():
            time.sleep(0.05)
        sys.exit(0)

    signal.signal(signal.SIGTERM, leave)
    die_with_parent(signal.SIGTERM)
    hold_card_locks()
    Path(sys.argv[1], "up").touch()
    time.sleep(600)
""")

FLOW = textwrap.dedent(f"""
    import logging, sys
    from pathlib import Path
    from gpuflow.tasks.devices.assign import DevicePlan
    from gpuflow.tasks.devices.cards import card_locks
    from gpuflow.tasks.child import run_child
    from gpuflow.tasks.launch import child_environment
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    plan = DevicePlan(strategy="ddp", backend="gloo", device="cuda", nproc_per_node=1, physical_ids=[0],
                      uuids=[{UUID!r}])
    with card_locks(plan) as locks:  # as flows/train.py holds them
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
               "--log-dir={TORCHRUN_LOGS}", *sys.argv[1:]]
        run_child(cmd, child_environment(plan), Path.cwd(), logging.getLogger("flow"), locks.fds)
""")


def test_a_rank_of_a_killed_flow_keeps_the_card_until_it_exits(tmp_path):
    (tmp_path / "rank.py").write_text(RANK)
    flow = subprocess.Popen([sys.executable, "-c", FLOW, str(tmp_path / "rank.py"), str(tmp_path)], cwd=ROOT,
                            env=child_env(GPUFLOW_LOCK_DIR=str(tmp_path), GPUFLOW_STOP_GRACE_S="60"),
                            stdout=subprocess.DEVNULL)
    try:
        wait_until(lambda: (tmp_path / "up").exists() or flow.poll() is not None, "the rank starts")
        assert flow.poll() is None, "the flow ended before its rank started"
        (reaper,) = psutil.Process(flow.pid).children()
        rank = reaper.children()[0].children()[0]  # flow -> reaper -> torchrun's agent -> rank
        probe = CardLocks(tmp_path, ranks_wait_s=0)
        assert not probe.try_lock(UUID)
        flow.kill()  # the flow dies outright: the kernel signals its reaper, which stops what is below it
        flow.wait()
        time.sleep(1)
        assert rank.is_running() and rank.status() != psutil.STATUS_ZOMBIE  # it waits for `release`: it still runs
        assert not probe.try_lock(UUID), "the card was free while a rank of the killed run still ran"
        (tmp_path / "release").touch()
        psutil.wait_procs([reaper], timeout=HANG_GUARD_S)  # it leaves last, once nothing of the run is left
        waiter = CardLocks(tmp_path, ranks_wait_s=HANG_GUARD_S)
        assert waiter.try_lock(UUID)  # and once the rank is gone, the card is free again
        waiter.release()
    finally:
        (tmp_path / "release").touch()  # nothing of the run outlives the test
        flow.kill()


# --- gpuflow infer / evaluate -------------------------------------------------------------


def test_gpuflow_infer_holds_its_card_while_its_evaluation_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFLOW_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setattr(infer, "read_environment", one_gpu_host)  # the probe reports one (fake) GPU
    ck, x = tmp_path / "ck.pt", tmp_path / "x.pt"
    torch.save({"model": SimpleNN(10).state_dict(), "config": TrainConfig().to_dict(), "num_classes": 10}, ck)
    torch.save({"inputs": torch.rand(3, 1, 28, 28)}, x)
    run_child, seen = registry.run_child, {}

    def run_child_with_a_look(cmd, env, cwd, log, hold_fds=()):
        ranks = CardLocks().path(UUID, "ranks")
        blocker = os.open(ranks, os.O_RDONLY)
        fcntl.flock(blocker, fcntl.LOCK_EX)  # the child must wait on it: the moment to look

        def look():
            try:
                seen["waiting"] = wait_until(lambda: waiting_on(ranks), "the evaluation asks for the card")
                seen["cmd"] = psutil.Process(next(iter(seen["waiting"]))).cmdline()
                seen["run lock held"] = held(CardLocks().path(UUID))
            finally:
                os.close(blocker)

        looker = threading.Thread(target=look)
        looker.start()
        try:
            return run_child(cmd, env, cwd, log, hold_fds)
        finally:
            looker.join()

    monkeypatch.setattr(registry, "run_child", run_child_with_a_look)
    out = infer.predict(InferParams(inputs=str(x), checkpoint=str(ck), gpus="0,"))
    assert out["samples"] == 3 and out["physical_gpu"] == 0
    assert "gpuflow.training.evaluate" in seen["cmd"]  # the child itself holds the card...
    assert seen["run lock held"]  # ...and so does the command, while the child runs
    assert CardLocks(ranks_wait_s=0).try_lock(UUID)  # both let go at the end


def test_a_process_started_after_its_run_ended_leaves_the_card_alone(tmp_path):
    """A rank whose agent died while it started cannot ask to die with it; it finds the run's
    flow gone once it holds the card's lock, and exits before touching the card."""
    ranks = tmp_path / "GPU-0.ranks"
    ranks.touch()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with pytest.raises(SystemExit, match=f"pid {gone.pid}.*has ended"):
        hold_card_locks({CARD_LOCKS_ENV: str(ranks), OWNER_ENV: str(gone.pid)})
    assert hold_card_locks({CARD_LOCKS_ENV: str(ranks), OWNER_ENV: str(os.getpid())})  # owner alive: held
