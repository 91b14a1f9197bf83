"""bench/sweep.py's Ray Tune arm, run by a Python that has Ray Tune (not a gpuflow dependency):

    python -m bench.sweep --ray /path/to/python-with-ray ...        (runs this in a subprocess)

The same search as the other arms: bench/sweep.py's space read by gpuflow's reader, its TPE sampler
(seeded, constant liar) through Ray's OptunaSearch, no scheduler (every trial runs to its end),
`--trials` trials 2 at a time (Ray started with 2 CPUs, one a trial), each trial the bare script
in a subprocess (`--python`, the project's interpreter, as the Optuna arms run it), or with
`--in-process` its loop in Ray's worker itself (Ray's own way: a worker kept for the next trial,
torch imported once a worker). Prints one JSON line: the best val_accuracy and the trials' summed
seconds. The caller times the whole process:
Python's start, Ray's import and start and shutdown are the Ray arm's fixed cost, as Prefect's are
the sweep's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
from functools import partial

from bench.common import ROOT
from bench.sweep import BARE, SLOTS, sampler


def suggested(dists: dict, trial) -> dict:
    """The trial's values, drawn as gpuflow's sweep draws them (Ray pickles the searcher: a module function)."""
    return {name: d.suggest(trial, name) for name, d in dists.items()}


def in_process(lr: float, optimizer: str, epochs: int) -> float:
    """bench/bare_ddp.py's one-process run (`--dataset digits --val`) in this process: its held-out accuracy."""
    import torch
    from torch.utils.data import TensorDataset

    from bench import bare_ddp as bare
    from gpuflow.training.config import TrainConfig
    from gpuflow.training.data import load_data

    torch.manual_seed(42)
    bundle = load_data(TrainConfig(dataset="digits", model="mlp"), fingerprint=False)
    model = bare.SimpleNN()
    bare.train(model, TensorDataset(bundle.train.x, bundle.train.y), epochs, 64, False, 0, 1, lr, optimizer)
    return bare.accuracy(model, bundle.val)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--space", required=True)
    p.add_argument("--storage", required=True, help="Ray's results folder")
    p.add_argument("--python", required=True, help="the interpreter of each trial's bare script")
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--in-process", action="store_true", help="each trial's loop in Ray's worker, not a subprocess")
    a = p.parse_args()

    import ray
    from ray import tune
    from ray.tune.search.optuna import OptunaSearch

    from gpuflow.flows.space import read_space

    dists = read_space(a.space)

    def trial(config: dict) -> None:
        if a.in_process:
            tune.report({"val_accuracy": in_process(config["lr"], config["optimizer"], a.epochs)})
            return
        out = subprocess.run([a.python, str(BARE), "--dataset", "digits", "--epochs", str(a.epochs), "--val",
                              "--lr", str(config["lr"]), "--optimizer", config["optimizer"]],
                             env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, check=True)
        tune.report({"val_accuracy": json.loads(out.stdout.strip().splitlines()[-1])["val_accuracy"]})

    ray.init(num_cpus=SLOTS, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})  # bench/ and gpuflow in Ray's workers
    search = OptunaSearch(space=partial(suggested, dists), metric="val_accuracy",
                          mode="max", sampler=sampler(a.seed, a.trials))
    tuner = tune.Tuner(tune.with_resources(trial, {"cpu": 1}),
                       tune_config=tune.TuneConfig(search_alg=search, num_samples=a.trials,
                                                   max_concurrent_trials=SLOTS, reuse_actors=a.in_process),
                       run_config=tune.RunConfig(storage_path=a.storage, verbose=0))
    grid = tuner.fit()
    if grid.errors:
        raise SystemExit(f"{len(grid.errors)} Ray trials failed: {grid.errors[0]}")
    print(json.dumps({"best": max(r.metrics["val_accuracy"] for r in grid),
                      "trial_s": sum(r.metrics["time_total_s"] for r in grid)}), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
