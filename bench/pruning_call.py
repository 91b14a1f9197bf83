"""The pruning decision's own cost per epoch line (issue #37): Optuna's `Trial.should_prune()` on a SQLite study
against flows/study.py `Pruning.says` (the study's pruner on the values as reported, against a copy of the
completed trials), interleaved, on the same study: 3 completed trials of 100 steps, then 100 steps of each arm.

    python -m bench.pruning_call [--repeats 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings


def main() -> None:
    import optuna

    from gpuflow.flows.study import Pruning

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    with tempfile.TemporaryDirectory() as d:
        study = optuna.create_study(storage=f"sqlite:///{d}/optuna.db",
                                    pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0))
        for k in range(3):
            done = study.ask()
            for step in range(1, 101):
                done.report(1.0 / step + k, step)
            study.tell(done, 0.5)
        for _ in range(a.repeats):
            for arm in ("Trial.should_prune", "Pruning.says"):
                trial, pruning, values, spent = study.ask(), Pruning(study), {}, 0.0
                for step in range(1, 101):
                    trial.report(1.0 / step + 10, step)
                    values[step] = 1.0 / step + 10
                    start = time.perf_counter()
                    trial.should_prune() if arm == "Trial.should_prune" else pruning.says(trial.number, values)
                    spent += time.perf_counter() - start
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                print(f"{arm}: {spent * 10:.2f} ms per epoch line", flush=True)


if __name__ == "__main__":
    main()
