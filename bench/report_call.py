"""A sweep trial's per-epoch report, as the flow makes it (issue #37): flows/trial.py `reporter` on a SQLite study,
each value written to the study as it arrives (STORE_EVERY_S = 0, as before) against at most once a second and at
the trial's end (the default), interleaved, with the median pruner deciding on every line. Lines come
`--epoch-ms` apart, as a short-epoch trial's do; the time counted (wall and the
thread's CPU) is the reporter's and the end's write.

    python -m bench.report_call [--repeats 2] [--epochs 100] [--epoch-ms 50]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from types import SimpleNamespace


def main() -> None:
    import optuna

    from gpuflow.flows import trial as trials
    from gpuflow.flows.study import Pruning

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--epoch-ms", type=float, default=50)
    a = ap.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    default = trials.STORE_EVERY_S
    with tempfile.TemporaryDirectory() as d:
        study = optuna.create_study(storage=f"sqlite:///{d}/optuna.db", pruner=optuna.pruners.MedianPruner())
        for k in range(3):
            done = study.ask()
            for step in range(1, a.epochs + 1):
                done.report(1.0 / step + k, step)
            study.tell(done, 0.5)
        pruning = Pruning(study)  # one per sweep, as the sweep keeps it
        pruning.completed()  # its first read of the completed trials, which the sweep makes once
        for _ in range(a.repeats):
            for arm, every in (("each value written as it arrives", 0.0), ("written at most once a second", default)):
                trials.STORE_EVERY_S = every
                t = trials.Trial(study.ask(), None, {}, pruning=pruning)
                report, spent, cpu = trials.reporter(t, SimpleNamespace(pruner="median"), "val_loss"), 0.0, 0.0
                for step in range(1, a.epochs + 1):
                    time.sleep(a.epoch_ms / 1000)
                    start, busy = time.perf_counter(), time.thread_time()
                    report(step, {"val_loss": 1.0 / step - 1})  # better than the others: never pruned
                    spent, cpu = spent + time.perf_counter() - start, cpu + time.thread_time() - busy
                start, busy = time.perf_counter(), time.thread_time()
                t.store()  # as the sweep does before telling the study the trial's end
                spent, cpu = spent + time.perf_counter() - start, cpu + time.thread_time() - busy
                assert study.trials[t.trial.number].intermediate_values == t.reported  # nothing lost
                study.tell(t.trial, state=optuna.trial.TrialState.PRUNED)
                print(f"{arm}: {spent / a.epochs * 1000:.2f} ms per epoch line, {cpu / a.epochs * 1000:.2f} ms of CPU",
                      flush=True)


if __name__ == "__main__":
    main()
