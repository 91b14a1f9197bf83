"""The card-lock folder against another unix account (a throwaway one each test makes with useradd): a link it
plants as a lock file never makes root's run write the file it points to, a folder it owns or may swap files in is
refused, and a folder root made (mode 1777) is still shared with it. Every refusal is one line naming the fix."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest

from gpuflow.tasks.devices.cards import CardLockError, CardLocks
from gpuflow.tasks.devices.slot import _holder_file
from gpuflow.training.cardlock import CARD_LOCKS_ENV, hold_card_locks

pytestmark = pytest.mark.fast  # a few short processes, as tests/test_card_locks.py
CPU_LOCK = f"{socket.gethostname()}-cpu0"  # what a CPU sweep's trial slot locks (flows/trial.py)
CONTENT = "root's own file\n"


@pytest.fixture
def other():
    """A second unix account, removed afterwards (files it made are removed with `base`)."""
    if os.geteuid() != 0 or not (shutil.which("useradd") and shutil.which("runuser")):
        pytest.skip("acting as a second unix account needs root, useradd and runuser")
    name = f"gpuflow-t{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture
def base():
    """A folder like /tmp (root's, mode 1777): pytest's tmp_path is root's alone."""
    path = Path(tempfile.mkdtemp(prefix="gpuflow-lock-folders-", dir="/tmp"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def roots_file(base):
    """A file of root's that the other account may read but not write: what its planted links point at."""
    path = base / "roots-file"
    path.write_text(CONTENT)
    path.chmod(0o644)
    return path


@pytest.fixture
def shared(base):
    """A lock folder as a root run makes it (mode 1777)."""
    folder = base / "locks"
    locks = CardLocks(folder, ranks_wait_s=0)
    assert locks.try_lock("GPU-made-by-root")
    locks.release()
    assert folder.stat().st_mode & 0o7777 == 0o1777
    return folder


def as_user(user: str, *cmd: str) -> None:
    subprocess.run(["runuser", "-u", user, "--", *cmd], check=True, capture_output=True, timeout=60, cwd="/")


def refused_sweep_slot(monkeypatch, folder: Path) -> str:
    """The one-line refusal of a root sweep's CPU slot lock, in the lock folder GPUFLOW_LOCK_DIR names."""
    monkeypatch.setenv("GPUFLOW_LOCK_DIR", str(folder))
    locks = CardLocks(ranks_wait_s=0)  # as flows/trial.py takes a CPU slot
    try:
        with pytest.raises(CardLockError) as refused:
            locks.try_lock(CPU_LOCK)
    finally:
        locks.release()
    message = str(refused.value)
    assert "\n" not in message and "GPUFLOW_LOCK_DIR" in message, message
    return message


def test_a_link_planted_in_another_accounts_folder_never_makes_root_overwrite_its_target(
        base, roots_file, other, monkeypatch):
    folder = base / "theirs"
    as_user(other, "mkdir", "-m", "1777", str(folder))
    as_user(other, "ln", "-s", str(roots_file), str(folder / f"{CPU_LOCK}.lock"))
    message = refused_sweep_slot(monkeypatch, folder)
    assert f"the card lock folder {folder} belongs to another account (owner {other}, mode 1777)" in message
    assert roots_file.read_text() == CONTENT


def test_a_link_planted_in_roots_shared_folder_is_refused_and_its_target_kept(
        shared, roots_file, other, monkeypatch):
    link = shared / f"{CPU_LOCK}.lock"
    as_user(other, "ln", "-s", str(roots_file), str(link))
    message = refused_sweep_slot(monkeypatch, shared)
    assert message.startswith(f"card lock file {link} is a symbolic link, not a lock file gpuflow made"), message
    assert roots_file.read_text() == CONTENT


def test_a_hard_link_in_roots_shared_folder_is_refused_and_its_target_kept(shared, roots_file, monkeypatch):
    # made by root here: this host's fs.protected_hardlinks stops an account linking a file it cannot write;
    # where it is 0, an account can plant one too
    link = shared / f"{CPU_LOCK}.lock"
    os.link(roots_file, link)
    message = refused_sweep_slot(monkeypatch, shared)
    assert message.startswith(f"card lock file {link} is a hard link (one of 2 names of one file)"), message
    assert roots_file.read_text() == CONTENT


def test_a_rank_refuses_a_planted_link_as_its_cards_ranks_file(shared, roots_file, other):
    link = shared / "GPU-0.ranks"
    as_user(other, "ln", "-s", str(roots_file), str(link))
    with pytest.raises(CardLockError, match=re.escape(f"card lock file {link} is a symbolic link")) as refused:
        hold_card_locks({CARD_LOCKS_ENV: str(link)})
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("kind", ["their folder", "their link to a folder of root's"])
def test_a_lock_folder_another_account_controls_is_refused_by_the_card_locks_and_the_device_slot(
        base, other, monkeypatch, kind):
    folder, roots_folder = base / "locks", base / "roots-folder"
    roots_folder.mkdir(mode=0o700)
    if kind == "their folder":
        as_user(other, "mkdir", "-m", "1777", str(folder))
        why = f"belongs to another account (owner {other}, mode 1777)"
    else:
        as_user(other, "ln", "-s", str(roots_folder), str(folder))
        why = f"is a symbolic link (owner {other}, mode 777)"
    assert f"the card lock folder {folder} {why}" in refused_sweep_slot(monkeypatch, folder)
    with pytest.raises(CardLockError, match=re.escape(f"the card lock folder {folder} {why}")):
        with _holder_file("gpuflow-devices-test", uuid.uuid4()):  # a device slot's holder file, in the same folder
            pass
    assert not list(roots_folder.iterdir()) and not list(folder.iterdir())  # nothing made in either


TRY = textwrap.dedent("""
    import sys
    from pathlib import Path
    from gpuflow.tasks.devices.cards import CardLockError, CardLocks
    for folder in sys.argv[1:]:
        try:
            locks = CardLocks(Path(folder), ranks_wait_s=0)
            print(locks.try_lock("GPU-made-by-root") and locks.try_lock("GPU-made-by-them"), flush=True)
            locks.release()
        except CardLockError as e:
            print(f"CardLockError: {e}", flush=True)
""")


def python_as(user: str, home: Path) -> list[str]:
    """A command running Python with gpuflow importable as `user` (this venv's interpreter may sit in root's home;
    then the system one of the same version loads the venv's packages)."""
    site_dir = sysconfig.get_paths()["purelib"]
    boot = f"import site, sys; sys.path.insert(0, {site_dir!r}); site.addsitedir({site_dir!r})\n"
    for exe in (sys.executable, f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"):
        cmd = ["runuser", "-u", user, "--", "env", f"HOME={home}", f"PREFECT_HOME={home / 'prefect'}", exe, "-c", boot]
        probe = cmd[:-1] + [boot + "import gpuflow.tasks.devices.cards"]
        if shutil.which(exe) and subprocess.run(probe, capture_output=True, cwd=home).returncode == 0:
            return cmd
    pytest.skip(f"user {user} cannot run a Python that imports gpuflow here")


def test_roots_sticky_folder_is_still_shared_with_another_account_and_one_without_the_sticky_bit_is_not(
        base, shared, other):
    open_folder = base / "no-sticky"
    open_folder.mkdir()
    open_folder.chmod(0o777)
    python = python_as(other, base)
    got = subprocess.run([*python[:-1], python[-1] + TRY, str(shared), str(open_folder)], capture_output=True,
                         text=True, cwd=base, timeout=120)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.splitlines() == [
        "True",  # root's lock file and one of its own, in root's 1777 folder
        f"CardLockError: the card lock folder {open_folder} is writable by other accounts without the sticky bit "
        f"(owner root, mode 777), so another account could make this run overwrite a file; remove it (a folder "
        "root makes, mode 1777, is shared safely), or set GPUFLOW_LOCK_DIR to a folder of your own"]
    locks = CardLocks(shared, ranks_wait_s=0)
    assert locks.try_lock("GPU-made-by-them")  # and root uses the file the other account made
    locks.release()
