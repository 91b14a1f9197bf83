"""Tracking overhead: the worker's training loop with MLflow logging on against off,
interleaved, same job.

"on" is the pipeline's way: the flow's tracker process (tasks/tracker.py) holds the run, rank 0
appends each epoch to the metrics file and the tracker logs it (and, as in the flow, the
tracker's registration imports run at low priority meanwhile). "logger" is a worker started by
hand with only MLFLOW_RUN_ID: rank 0's own MLflow logger process (training/metrics_logger.py).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.common import fmt, run_worker, summary

MODES = ("off", "on", "logger")


def one(tmp: Path, a, mode: str, uri: str, run_n: int) -> tuple[float, float]:
    import mlflow

    from gpuflow.tasks.tracker import Tracker
    from gpuflow.training.tracking import METRICS_FILE_ENV

    client = mlflow.MlflowClient(tracking_uri=uri)
    cfg = {"dataset": "synthetic", "synthetic_size": a.size, "epochs": a.epochs, "model": a.model,
           "resume": "never", "checkpoint_dir": str(tmp / "ck"), "strategy": "ddp", "device": "cpu"}
    extra = {"MLFLOW_TRACKING_URI": uri}
    tracker, run_id = None, None
    if mode == "on":
        tracker = Tracker()
        run_id = tracker.call("start", uri=uri, experiment="bench-tracking", run_name=f"on-{run_n}",
                              params={}, tags={}, dataset={"name": "synthetic", "sha256": "0" * 64,
                                                           "num_samples": a.size}, artifacts=[])["run_id"]
        metrics = tmp / f"metrics-{run_n}.jsonl"
        tracker.call("follow", run_id=run_id, path=str(metrics))
        extra.update({"MLFLOW_RUN_ID": run_id, METRICS_FILE_ENV: str(metrics)})
    elif mode == "logger":
        exp = client.get_experiment_by_name("bench-tracking") or client.get_experiment(
            client.create_experiment("bench-tracking"))
        run_id = client.create_run(exp.experiment_id, run_name=f"logger-{run_n}").info.run_id
        extra["MLFLOW_RUN_ID"] = run_id
    res, wall = run_worker(tmp, cfg, world=2, **extra)
    if tracker is not None:
        tracker.call("end", run_id=run_id, status="FINISHED")
        tracker.close()
    if run_id:
        if mode == "logger":
            client.set_terminated(run_id)
        assert len(client.get_metric_history(run_id, "train_loss")) == a.epochs, mode
    return res["train_time_s"], wall


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--size", type=int, default=8192)
    p.add_argument("--model", default="cnn")
    a = p.parse_args(argv)
    loop: dict[str, list[float]] = {m: [] for m in MODES}
    wall: dict[str, list[float]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        uri = f"sqlite:///{tmp / 'mlflow.db'}"
        from gpuflow.tasks.mlrun import prepare_store

        prepare_store(uri)
        for i in range(a.repeats):
            # rotate the order (off-on-logger, on-logger-off, ...): a run's place in a group
            # changed its time on this VM, which a fixed order would book as overhead
            order = MODES[i % 3:] + MODES[:i % 3]
            for mode in order:
                t, w = one(tmp, a, mode, uri, i)
                loop[mode].append(t)
                wall[mode].append(w)
    paired = {m: summary([100 * (x - y) / y for x, y in zip(loop[m], loop["off"], strict=True)])
              for m in ("on", "logger")}
    return {"args": vars(a), **{m: summary(loop[m]) for m in MODES},
            **{f"wall_{m}": summary(wall[m]) for m in MODES}, "paired": paired}


def table(res: dict) -> str:
    off = res["off"]["median"]
    a = res["args"]
    rows = ["| training loop (train+eval+checkpoint+logging) | seconds, median (min-max) | "
            "overhead, medians | overhead within each group, median (min-max) |", "|---|---|---|---|",
            f"| MLflow logging off | {fmt(res['off'], 2)} | | |"]
    for mode, label in (("on", "on, the pipeline's way (metrics file, relayed by the flow's tracker)"),
                        ("logger", "on, worker started by hand (rank 0's own MLflow logger process)")):
        if mode not in res:
            continue
        pp = res["paired"][mode]
        rows.append(f"| {label} | {fmt(res[mode], 2)} | {100 * (res[mode]['median'] - off) / off:+.1f}% | "
                    f"{pp['median']:+.1f}% ({pp['min']:+.1f}% to {pp['max']:+.1f}%) |")
    rows += ["", "Whole process (torchrun start to exit), median s: " + ", ".join(
        f"{m} {res[f'wall_{m}']['median']:.2f}" for m in MODES if f"wall_{m}" in res) + ".",
        "", f"Job: {a['model']} on {a['size']} synthetic samples, {a['epochs']} epochs, DDP 2 x gloo; "
        f"{a['repeats']} groups, goal: under 1% for the pipeline's way."]
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(main()))
