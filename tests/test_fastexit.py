"""training/fastexit.py: the exit code is kept, exit handlers and buffered output are not lost."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT

SCRIPT = """
import atexit, sys
from training import fastexit
fastexit.arm()
atexit.register(lambda: open(sys.argv[1], "w").write("handler ran"))
sys.stdout.write("buffered, no newline")
if sys.argv[2] == "fast":
    fastexit.exit_after_cleanup(3)
    sys.exit(3)
raise RuntimeError("boom")
"""


def test_fast_exit_runs_handlers_flushes_output_and_keeps_the_code(tmp_path):
    mark = tmp_path / "mark"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(mark), "fast"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3
    assert proc.stdout == "buffered, no newline"
    assert mark.read_text() == "handler ran"


def test_an_uncaught_exception_exits_the_usual_way(tmp_path):
    mark = tmp_path / "mark"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(mark), "raise"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "RuntimeError: boom" in proc.stderr
    assert mark.read_text() == "handler ran"
