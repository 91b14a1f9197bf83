"""Rank-0 metric streaming into the MLflow run the flow created (attach, never create)."""

from __future__ import annotations

import os
import sys
import time


class MetricsSink:
    """Logs per-epoch metrics to MLFLOW_RUN_ID when set and this is global rank 0."""

    def __init__(self, is_main: bool):
        self.run_id = os.environ.get("MLFLOW_RUN_ID") if is_main else None
        self._client = None
        if self.run_id:
            from mlflow.tracking import MlflowClient  # heavy: import only when used

            self._client = MlflowClient()

    def log_epoch(self, epoch: int, metrics: dict[str, float]) -> None:
        if not self._client:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, epoch) for k, v in metrics.items()]
        try:
            self._client.log_batch(self.run_id, metrics=batch, synchronous=True)
        except Exception as e:  # tracking trouble must not kill training; result.json keeps all
            print(f"[rank 0] warning: could not log metrics to MLflow: {e}", file=sys.stderr)
