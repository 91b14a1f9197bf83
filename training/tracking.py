"""Rank-0 metric streaming into the MLflow run the flow created (attach, never create).

Two ways, both one JSON line per epoch, so the training process never imports MLflow:

- Under the flow (GPUFLOW_METRICS_FILE set): rank 0 appends the line to that file, and the
  flow's tracker process, which has MLflow loaded already, logs each new line to the run
  within half a second (tasks/tracker.py). Nothing MLflow runs beside the ranks.
- Started by hand with MLFLOW_RUN_ID only: rank 0 starts `training/metrics_logger.py` as its
  own child process, first thing; the logger imports MLflow and connects while the ranks
  import torch, meet and load data.

Torch-free: rank 0 creates the sink before it imports torch.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

LOGGER = Path(__file__).with_name("metrics_logger.py")
METRICS_FILE_ENV = "GPUFLOW_METRICS_FILE"  # set by the flow: its tracker relays the lines
READY_TIMEOUT_S = 60.0  # the loop starts anyway after this; epochs queue in the pipe meanwhile
CLOSE_TIMEOUT_S = 120.0  # how long rank 0 waits at exit for queued metrics to be written


def close_child(proc: subprocess.Popen, timeout: float) -> bool:
    """Close a helper's input (its signal to finish) and wait; kill it after `timeout` s.

    True if it exited by itself in time.
    """
    try:
        proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(timeout)
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False


class MetricsSink:
    """Logs per-epoch metrics to MLFLOW_RUN_ID when set and this is global rank 0."""

    def __init__(self, is_main: bool):
        self.run_id = os.environ.get("MLFLOW_RUN_ID") if is_main else None
        self._proc: subprocess.Popen | None = None
        self._file = None
        self._status: str | None = None
        self._got_status = threading.Event()
        if not self.run_id:
            return
        relay = os.environ.get(METRICS_FILE_ENV)
        if relay:
            try:
                self._file = open(relay, "a", encoding="utf-8")
            except OSError as e:
                self._disable(f"cannot write the metrics file {relay!r}: {e}")
            return
        try:
            # -P: the script's folder (training/, with config.py, data.py...) stays off sys.path
            self._proc = subprocess.Popen([sys.executable, "-P", "-u", str(LOGGER)], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, bufsize=1)
        except OSError as e:
            self._disable(f"could not start the MLflow logger: {e}")
            return
        threading.Thread(target=self._read_status, name="gpuflow-mlflow-status", daemon=True).start()
        atexit.register(self.close)

    def _read_status(self) -> None:
        line = self._proc.stdout.readline().strip()
        self._status = line or "error the MLflow logger exited before connecting (see its stderr above)"
        self._got_status.set()

    def _disable(self, why: str) -> None:
        """Warn once (run_id is cleared, so no caller gets here twice) and stop logging."""
        print(f"[rank 0] warning: MLflow unavailable, metrics stay in result.json: {why}",
              file=sys.stderr, flush=True)
        self.run_id = None

    def _failed(self) -> bool:
        """Turn an `error` status from the logger into that warning; True once logging is off."""
        if self.run_id and self._status and self._status.startswith("error"):
            self._disable(f"run {self.run_id}: {self._status.removeprefix('error').strip()}")
        return not self.run_id

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Before the loop: let the logger finish connecting, and report a bad run id early."""
        if self._proc is not None and self.run_id:
            self._got_status.wait(timeout)
            if self._failed():
                self.close()

    def log_epoch(self, epoch: int, metrics: dict[str, float]) -> None:
        if not self.run_id:
            return
        line = json.dumps({"step": epoch, "timestamp": int(time.time() * 1000),
                           "metrics": {k: float(v) for k, v in metrics.items()}})
        if self._file is not None:
            try:  # a whole line per write: the tracker logs complete lines only
                self._file.write(line + "\n")
                self._file.flush()
            except OSError as e:
                self._disable(f"cannot write the metrics file: {e}")
            return
        if self._proc is None:
            return
        if self._failed():
            self.close()
            return
        try:
            self._proc.stdin.write(line + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError) as e:
            self._disable(f"the MLflow logger stopped ({type(e).__name__}: {e})")

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Let the logger write what it has queued and exit (idempotent)."""
        f, self._file = self._file, None
        if f is not None:
            f.close()
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if not close_child(proc, timeout):
            print(f"[rank 0] warning: the MLflow logger did not finish within {timeout:.0f} s and was "
                  "stopped; some metrics may be missing from MLflow (result.json has them all)",
                  file=sys.stderr, flush=True)
        self._got_status.wait(1)
        self._failed()
