"""Tracking overhead: the worker's training loop with MLflow tracking on against off, same job,
the two runs of each group back to back in rotating order.

"on" is the pipeline's way: this process holds a real MLflow run on SQLite, opened with the
flow's own `tracked_run` (gpuflow.tasks.tracking.tracked), and its `MetricsRelay` thread logs each line
rank 0 appends to the metrics file (GPUFLOW_METRICS_FILE) while the worker trains. "off" is
the same worker without a metrics file: no live metrics, result.json only.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.common import fmt, run_worker, summary

MODES = ("off", "on")


def one(tmp: Path, a, mode: str, uri: str, group: int) -> tuple[float, float]:
    """One worker run (DDP, 2 processes); (training-loop seconds, whole-process seconds)."""
    cfg = {"dataset": "synthetic", "synthetic_size": a.size, "epochs": a.epochs, "model": a.model,
           "resume": "never", "checkpoint_dir": str(tmp / "ck"), "strategy": "ddp", "device": "cpu"}
    if mode == "off":
        res, wall = run_worker(tmp, cfg, world=2)
        return res["train_time_s"], wall
    from gpuflow.tasks.tracking.tracked import tracked_run
    from gpuflow.training.metrics import METRICS_FILE_ENV

    dataset = {"name": "synthetic", "sha256": "0" * 64, "num_samples": a.size}
    with tracked_run(uri, "bench-tracking", f"on-{group}", {}, dataset, tmp / "runs") as run, \
            run.relaying_metrics() as relay:
        res, wall = run_worker(tmp, cfg, world=2, **{METRICS_FILE_ENV: str(run.metrics_file)})
    assert relay.logged == a.epochs, f"relayed {relay.logged} of {a.epochs} epochs"
    assert len(run.client.get_metric_history(run.run_id, "train_loss")) == a.epochs
    return res["train_time_s"], wall


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=3, help="groups of one off and one on run")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--size", type=int, default=8192)
    p.add_argument("--model", default="cnn")
    a = p.parse_args(argv)
    loop: dict[str, list[float]] = {m: [] for m in MODES}
    wall: dict[str, list[float]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        uri = f"sqlite:///{tmp / 'mlflow.db'}"
        from gpuflow.tasks.tracking.store import prepare_store

        prepare_store(uri)  # the schema, once, as an existing mlflow.db has it
        for i in range(a.repeats):
            # alternate the order (off-on, on-off, ...): a run's place in a group can change
            # its time on a shared machine, which a fixed order would book as overhead
            for mode in MODES if i % 2 == 0 else MODES[::-1]:
                t, w = one(tmp, a, mode, uri, i)
                loop[mode].append(t)
                wall[mode].append(w)
    paired = summary([100 * (on - off) / off for on, off in zip(loop["on"], loop["off"], strict=True)])
    return {"args": vars(a), **{m: summary(loop[m]) for m in MODES},
            **{f"wall_{m}": summary(wall[m]) for m in MODES}, "paired": {"on": paired}}


def table(res: dict) -> str:
    off, on, pp, a = res["off"], res["on"], res["paired"]["on"], res["args"]
    rows = [("| training loop (train+eval+checkpoint+logging) | seconds, median (min-max) | "
             "overhead, medians | overhead within each group, median (min-max) |"), "|---|---|---|---|",
            f"| MLflow tracking off (no metrics file) | {fmt(off, 2)} | | |",
            (f"| on, the pipeline's way (metrics file, relayed by a thread in the flow's process) | "
             f"{fmt(on, 2)} | {100 * (on['median'] - off['median']) / off['median']:+.1f}% | "
             f"{pp['median']:+.1f}% ({pp['min']:+.1f}% to {pp['max']:+.1f}%) |"),
            "", ("Whole worker process (torchrun start to exit), median s: "
                 f"off {res['wall_off']['median']:.2f}, on {res['wall_on']['median']:.2f}."),
            "", (f"Job: {a['model']} on {a['size']} synthetic samples, {a['epochs']} epochs, DDP 2 x gloo; "
                 f"{a['repeats']} groups, goal: under 1%.")]
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(main()))
