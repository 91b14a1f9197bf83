"""Rank 0's MLflow logger: a child process of global rank 0 that attaches to MLFLOW_RUN_ID.

    python -P training/metrics_logger.py      (started by training.tracking.MetricsSink)

Importing MLflow (~1.2 s) and building its store (~0.6 s) is CPU work that, in rank 0's own
process, held the GIL while rank 0 loaded data and then delayed its first step (every other
rank waits for rank 0 at the first all-reduce). In this process it runs beside the ranks'
own start-up, as W&B does with its service process. It never creates or ends a run.

Protocol: one status line on stdout once connected, `ready` or `error <message>`; then one
JSON object per line on stdin, {"step": int, "timestamp": ms, "metrics": {name: value}},
each logged as one synchronous log_batch. It exits at end of input (rank 0 closed the pipe,
or died) after logging everything it read. Imports only the standard library and MLflow.
"""

from __future__ import annotations

import json
import os
import sys


def log_line(client, run_id: str, line: str | bytes) -> None:
    """Log one line of MetricsSink's format as one synchronous log_batch.

    Shared with the flow's tracker (tasks/tracker.py), which reads the same lines from a file.
    """
    from mlflow.entities import Metric

    rec = json.loads(line)
    batch = [Metric(k, float(v), int(rec["timestamp"]), int(rec["step"])) for k, v in rec["metrics"].items()]
    client.log_batch(run_id, metrics=batch, synchronous=True)


def warn(msg: str) -> None:
    print(f"[rank 0] warning: {msg}", file=sys.stderr, flush=True)


def main() -> int:
    run_id = os.environ.get("MLFLOW_RUN_ID", "")
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient()
        client.get_run(run_id)  # builds the store and checks the run exists
    except Exception as e:
        print("error " + f"{type(e).__name__}: {e}".replace("\n", " ")[:2000], flush=True)
        return 3
    print("ready", flush=True)
    try:  # from here on it is background work: where cores are short, the ranks come first
        os.nice(10)
    except (AttributeError, OSError):
        pass
    for line in sys.stdin:
        try:
            log_line(client, run_id, line)
        except Exception as e:  # tracking trouble must not kill training; result.json keeps all
            warn(f"could not log metrics to MLflow: {type(e).__name__}: {e}")
    return 0


if __name__ == "__main__":
    code = main()
    # Every batch above was committed synchronously; skipping the interpreter's teardown of
    # MLflow and SQLAlchemy (~0.8 s, measured) lets rank 0, which waits for this exit, leave.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
