"""Tracking on the team stack (PostgreSQL behind MLflow's HTTP server) vs a SQLite mlflow.db.

The same `gpuflow run` (its defaults: mlp on digits, 3 epochs, DDP over gloo with 2 processes),
interleaved, against the stack's tracking server and against a SQLite file, both with the
stack's Prefect server; and the logging calls alone: 200 metric batches (one per call, as the
relay sends them) and one 1 MiB artifact, on each store.

    python -m bench.stack [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import PY, fmt, run, summary
from bench.overhead import last_json
from tests.test_stack import Stack


def logging_calls(uri: str, tmp: Path) -> float:
    """Seconds for 200 single-metric batches and one 1 MiB artifact in a new run."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("bench-stack") or client.get_experiment(client.create_experiment("bench-stack"))
    run = client.create_run(exp.experiment_id)
    blob = tmp / "blob.bin"
    blob.write_bytes(os.urandom(2**20))
    start = time.perf_counter()
    for step in range(200):
        client.log_batch(run.info.run_id, metrics=[Metric("loss", 1.0 / (step + 1), int(time.time() * 1000), step)],
                         synchronous=True)
    client.log_artifact(run.info.run_id, str(blob), "bench")
    seconds = time.perf_counter() - start
    client.set_terminated(run.info.run_id)
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="gpuflow-bench-stack-"))
    base.chmod(0o755)
    stack = Stack(base / "data")
    stack.start()
    os.environ.update(stack.credentials())  # both servers ask for them: the runs and this process's MLflow client
    try:
        stores = {"sqlite": f"sqlite:///{base / 'mlflow.db'}", "stack": stack.ui}
        walls: dict[str, list[float]] = {k: [] for k in stores}
        calls: dict[str, list[float]] = {k: [] for k in stores}
        for _ in range(a.repeats):
            for name, uri in stores.items():
                wall, out = run([PY, "-m", "gpuflow.flows", "run", "--tracking-uri", uri, "--runs-dir",
                                 str(base / "runs")], cwd=base, PREFECT_API_URL=stack.api)
                assert last_json(out)["status"] == "FINISHED"
                walls[name].append(wall)
                calls[name].append(logging_calls(uri, base))
    finally:
        stack.stop()
    print(f"{os.cpu_count()} CPUs, {a.repeats} of each, interleaved, Prefect on the stack")
    for name in stores:
        print(f"{name:7s} gpuflow run {fmt(summary(walls[name]), 1)} s; 200 metric batches + 1 MiB artifact "
              f"{fmt(summary(calls[name]), 2)} s")
    med = {k: statistics.median(v) for k, v in walls.items()}
    print(f"stack / sqlite: run {med['stack'] / med['sqlite']:.2f} ({med['stack'] - med['sqlite']:+.1f} s), "
          f"logging calls {statistics.median(calls['stack']) / statistics.median(calls['sqlite']):.2f}")


if __name__ == "__main__":
    main()
