"""Rank 0's per-epoch metrics: one JSON line per epoch, appended to GPUFLOW_METRICS_FILE, which the flow relays
to MLflow (tasks/tracking/tracked.py), so the ranks never import MLflow."""

from __future__ import annotations

import json
import os
import sys
import time

from .contract import METRICS_FILE_ENV, main_line

MODEL_FILE = "model.json"  # in a script's output folder: the model it declared (reference and kwargs)
EXAMPLE_STEM = "input_example"  # and its input example, when declared with one: .npy, or .npz (named inputs)


def format_line(step: int, metrics: dict[str, float]) -> str:
    metrics = {k: float(v) for k, v in metrics.items()}
    return json.dumps({"step": step, "timestamp": int(time.time() * 1000), "metrics": metrics})


def parse_line(line: str | bytes) -> tuple[int, int, dict[str, float]]:
    """(step, timestamp in ms, metrics) from one line written by `MetricsFile`."""
    rec = json.loads(line)
    return int(rec["step"]), int(rec["timestamp"]), {k: float(v) for k, v in rec["metrics"].items()}


class MetricsFile:
    """Appends an epoch's metrics as one line, on global rank 0, when the flow asked for them."""

    def __init__(self, is_main: bool, path: str | None = None):
        path = path or os.environ.get(METRICS_FILE_ENV)
        self._file = None
        if is_main and path:
            try:
                self._file = open(path, "a", encoding="utf-8")
            except OSError as e:
                self._warn(f"cannot write the metrics file {path!r}: {e}")

    def log_epoch(self, epoch: int, metrics: dict[str, float]) -> None:
        if self._file is None:
            return
        try:  # a whole line per write: the relay logs complete lines only
            self._file.write(format_line(epoch, metrics) + "\n")
            self._file.flush()
        except OSError as e:
            self._warn(f"cannot write the metrics file: {e}")
            self.close()

    def close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            f.close()

    @staticmethod
    def _warn(why: str) -> None:
        print(main_line(f"warning: live metrics off, result.json keeps them all: {why}"), file=sys.stderr, flush=True)
