"""Tracking overhead: the worker's training loop with MLflow logging on (rank 0 attached to
a run in a SQLite store, metrics every epoch) against off, interleaved, same job."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.common import fmt, run_worker, summary


def one(tmp: Path, a, run_id: str | None, uri: str) -> tuple[float, float]:
    cfg = {"dataset": "synthetic", "synthetic_size": a.size, "epochs": a.epochs, "model": a.model,
           "resume": "never", "checkpoint_dir": str(tmp / "ck"), "strategy": "ddp", "device": "cpu"}
    extra = {"MLFLOW_TRACKING_URI": uri, **({"MLFLOW_RUN_ID": run_id} if run_id else {})}
    res, wall = run_worker(tmp, cfg, world=2, **extra)
    return res["train_time_s"], wall


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--size", type=int, default=8192)
    p.add_argument("--model", default="cnn")
    a = p.parse_args(argv)
    import mlflow

    on, off, wall_on, wall_off = [], [], [], []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        uri = f"sqlite:///{tmp / 'mlflow.db'}"
        from tasks.mlrun import prepare_store

        prepare_store(uri)
        client = mlflow.MlflowClient()
        exp = client.create_experiment("bench-tracking")
        for i in range(a.repeats):
            rid = client.create_run(exp).info.run_id
            pair = [(None, off, wall_off), (rid, on, wall_on)]
            # alternate which goes first (off-on, on-off, ...): the second run of a pair was
            # measured slower either way on this VM, which a fixed order books as overhead
            for runid, loop, wall in (pair if i % 2 == 0 else pair[::-1]):
                t, w = one(tmp, a, runid, uri)
                loop.append(t)
                wall.append(w)
            client.set_terminated(rid)
            assert len(client.get_metric_history(rid, "train_loss")) == a.epochs
    paired = [100 * (x - y) / y for x, y in zip(on, off, strict=True)]
    return {"args": vars(a), "on": summary(on), "off": summary(off), "wall_on": summary(wall_on),
            "wall_off": summary(wall_off), "paired_pct": summary(paired)}


def table(res: dict) -> str:
    on, off = res["on"]["median"], res["off"]["median"]
    a = res["args"]
    return "\n".join([
        "| training loop (train+eval+checkpoint+logging) | seconds, median (min-max) |", "|---|---|",
        f"| MLflow logging off | {fmt(res['off'], 2)} |",
        f"| MLflow logging on (rank 0, every epoch) | {fmt(res['on'], 2)} |",
        f"| overhead (goal < 1%), medians | {100 * (on - off) / off:+.1f}% |",
        *([f"| overhead within each on/off pair, median (min-max) | {res['paired_pct']['median']:+.1f}% "
           f"({res['paired_pct']['min']:+.1f}% to {res['paired_pct']['max']:+.1f}%) |"] if "paired_pct" in res else []),
        f"| whole process (torchrun start to exit), off / on | {fmt(res['wall_off'], 2)} / "
        f"{fmt(res['wall_on'], 2)} |",
        "", f"Job: {a['model']} on {a['size']} synthetic samples, {a['epochs']} epochs, DDP 2 x gloo.",
    ])


if __name__ == "__main__":
    print(table(main()))
