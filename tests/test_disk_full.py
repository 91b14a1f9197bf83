"""A full disk anywhere in a run ends it with the one-line disk-full message, recorded as a deterministic failure
(a restarted rank does not run again), even when the ranks' error folder is on that disk; the flow's own write
of a child's log stops the child with it (training/contract.py, training/__main__.py, tasks/child.py)."""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
import textwrap
import time

import pytest

from gpuflow.tasks.child import run_child
from gpuflow.tasks.failure import would_repeat
from gpuflow.training import contract
from gpuflow.training.errors import DiskFull
from tests.helpers import child_env, run_worker
from tests.test_bad_data import small_disk  # noqa: F401  (a fixture: a 64 KiB tmpfs)

FILLER = textwrap.dedent("""
    import os, torch

    class Net(torch.nn.Linear):
        '''A linear model whose building takes every free byte of FILL_DISK first, as another job would.'''
        def __init__(self, num_classes=10, input_shape=(1, 8, 8)):
            super().__init__(int(torch.tensor(input_shape).prod()), num_classes)
            try:
                with open(os.path.join(os.environ["FILL_DISK"], "filler"), "ab", buffering=0) as f:
                    while True:
                        f.write(bytes(4096))
            except OSError:
                pass

        def forward(self, x):
            return super().forward(x.flatten(1))
""")


def fill(folder) -> None:
    """Take every free byte of the disk `folder` is on."""
    with open(folder / "filler", "wb", buffering=0) as f:
        with pytest.raises(OSError) as full:
            while True:
                f.write(bytes(4096))
    assert full.value.errno == errno.ENOSPC


def full_write(folder) -> OSError:
    """The error a write to the full disk of `folder` raises, with its traceback (as a rank's code meets it)."""
    try:
        with open(folder / "more", "ab", buffering=0) as f:
            f.write(bytes(4096))
    except OSError as e:
        return e
    raise AssertionError("the disk is not full")


def test_a_ranks_full_disk_is_recorded_as_deterministic_on_that_full_disk_and_not_run_again(small_disk,
                                                                                            monkeypatch):
    monkeypatch.setenv(contract.ERROR_DIR_ENV, str(small_disk / "errors"))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    contract.start_attempt()
    fill(small_disk)
    contract.write_error(full_write(small_disk), deterministic=False)  # as after progress: a full disk repeats
    record = contract.read_error(small_disk / "errors")
    assert record["type"] == "DiskFull" and record["deterministic"] is True, record
    assert record["message"].startswith("disk full: a write at ") and "free space on that disk" in record["message"]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun's restart of the rank
    contract.start_attempt()
    assert contract.replay_deterministic()["type"] == "DiskFull"
    assert contract.read_error(small_disk / "errors")["attempt"] == 1  # what the flow reads: the last attempt's


def test_a_full_disk_is_a_failure_that_would_repeat():
    assert would_repeat(OSError(errno.ENOSPC, "No space left on device"))
    assert not would_repeat(RuntimeError("save failed"))
    wrapped = RuntimeError("torch.save failed")
    wrapped.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert would_repeat(wrapped)


def test_a_worker_on_a_full_disk_exits_2_with_one_disk_full_line_and_a_deterministic_record(tmp_path, small_disk):
    (tmp_path / "fillnet.py").write_text(FILLER)
    env = child_env(FILL_DISK=str(small_disk), PYTHONPATH=str(tmp_path),
                    **{contract.ERROR_DIR_ENV: str(small_disk / "errors")})
    proc = run_worker(tmp_path / "w", env=env, check=False, epochs=1, model=f"{tmp_path / 'fillnet.py'}:Net",
                      checkpoint_dir=str(small_disk / "ckpt"), max_steps_per_epoch=1)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "[rank 0] error: disk full: " in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    record = contract.read_error(small_disk / "errors")
    assert record["type"] == "DiskFull" and record["deterministic"] is True, record


CHATTY = """
import os, sys, time
open(sys.argv[1], "w").write(str(os.getpid()))
for i in range(5000):
    print(f"line {i} of a child that keeps talking while the disk of its log is full", flush=True)
time.sleep(300)
"""


def test_a_full_disk_under_the_childs_log_stops_the_child_with_one_disk_full_error(tmp_path, small_disk):
    fill(small_disk)
    log_file, pid_file = small_disk / "logs" / "worker.log", tmp_path / "child.pid"
    started = time.monotonic()
    with pytest.raises(DiskFull, match=rf"^disk full: cannot write '{log_file}' \(No space left on device\); "
                                       "free space on that disk"):
        run_child([sys.executable, "-c", CHATTY, str(pid_file)], child_env(), tmp_path, logging.getLogger("child"),
                  log_file=log_file)
    assert time.monotonic() - started < 60  # stopped, not waited for
    pid = int(pid_file.read_text())
    for _ in range(100):  # its reaper takes it down with it
        if not _alive(pid):
            break
        time.sleep(0.05)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has ended
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_the_record_of_a_full_disk_names_the_file_when_the_error_does(small_disk, monkeypatch):
    monkeypatch.setenv(contract.ERROR_DIR_ENV, str(small_disk / "errors"))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    contract.start_attempt()
    fill(small_disk)
    contract.write_error(OSError(errno.ENOSPC, "No space left on device", str(small_disk / "x.pt")), True)
    record = json.loads((small_disk / "errors" / "attempt-0" / "rank-0.json").read_text())
    assert record["message"].startswith(f"disk full: cannot write '{small_disk / 'x.pt'}' (No space left")
