"""Rank-0 metric streaming into the MLflow run the flow created (attach, never create)."""

from __future__ import annotations

import os
import sys
import threading
import time


class MetricsSink:
    """Logs per-epoch metrics to MLFLOW_RUN_ID when set and this is global rank 0."""

    def __init__(self, is_main: bool):
        self.run_id = os.environ.get("MLFLOW_RUN_ID") if is_main else None
        self._client = None
        self._ready: threading.Thread | None = None
        self._error: Exception | None = None
        if self.run_id:  # mlflow takes ~1.2 s to import: do it while data loads and ranks meet
            self._ready = threading.Thread(target=self._connect, daemon=True)
            self._ready.start()

    def _connect(self) -> None:
        try:
            from mlflow.tracking import MlflowClient

            client = MlflowClient()
            # The store (SQLAlchemy engine, schema check: ~0.8 s) is built lazily at the first
            # call; make that call here, off the training loop, and check the run exists.
            client.get_run(self.run_id)
            self._client = client
        except Exception as e:  # reported once, at the first log_epoch
            self._error = e

    def wait_ready(self) -> None:
        """Finish connecting (startup work) before the training loop starts."""
        if self._ready:
            self._ready.join()

    def log_epoch(self, epoch: int, metrics: dict[str, float]) -> None:
        if not self._ready:
            return
        self._ready.join()
        if self._client is None:
            print(f"[rank 0] warning: MLflow unavailable, metrics stay in result.json: {self._error}",
                  file=sys.stderr)
            self._ready = None
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, epoch) for k, v in metrics.items()]
        # Synchronous on purpose: one SQLite write is 10-20 ms an epoch, while MLflow's async
        # queue costs ~2 s at process exit (measured, see bench/RESULTS.md).
        try:
            self._client.log_batch(self.run_id, metrics=batch, synchronous=True)
        except Exception as e:  # tracking trouble must not kill training; result.json keeps all
            print(f"[rank 0] warning: could not log metrics to MLflow: {e}", file=sys.stderr)
