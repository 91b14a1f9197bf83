"""Pruning that stops: `gpuflow sweep --pruner median` against Optuna's own MedianPruner in two
plain processes, on short epochs (mlp on digits: tens of milliseconds each, the output never pauses).

The same search in both arms: lr (log float) and optimizer (tests/test_sweep.py's space), TPE
seeded as gpuflow seeds it, `--trials` trials of `--epochs` epochs, two at a time, a
MedianPruner(n_startup_trials=2, n_warmup_steps=0) as gpuflow builds it (flows/study.py). The
plain arm runs bench/bare_ddp.py per trial, reads its per-epoch held-out accuracy, reports it
and kills the trial when pruned (Optuna's documented pattern). Epochs trained: the val_accuracy
points of gpuflow's trial runs; the lines the plain arm read.

Goals (issue 37): epochs saved by gpuflow >= 90% of what the plain arm saves; its best no more
than 0.5% below the plain arm's.

    python -m bench.prune [--trials 8] [--epochs 60] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import tempfile
import textwrap
from pathlib import Path

import optuna

from bench.common import PY, ROOT, env, run
from bench.sweep import BARE, SPACE, client, fresh, run_processes, sampler, study, sweep_cmd, trial_runs
from tests.servers import prefect_server

SAVED_GOAL, SCORE_GOAL = 0.90, 0.005
optuna.logging.set_verbosity(optuna.logging.WARNING)


def pruner():
    return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0)  # gpuflow's (flows/study.py)


def plain_process(storage: str, n: int, seed: int, trials: int, epochs: int, space: str) -> None:
    """A plain Optuna process: n trials, each the bare script, pruned from its per-epoch lines."""
    from gpuflow.flows.space import read_space

    dists = read_space(space)
    s = optuna.load_study(study_name="plain", storage=storage, sampler=sampler(seed, trials), pruner=pruner())

    def objective(trial) -> float:
        v = {name: d.suggest(trial, name) for name, d in dists.items()}
        proc = subprocess.Popen([PY, str(BARE), "--dataset", "digits", "--epochs", str(epochs), "--val-each-epoch",
                                 "--lr", str(v["lr"]), "--optimizer", v["optimizer"]], stdout=subprocess.PIPE,
                                text=True, env=env(), cwd=ROOT)
        seen, score = 0, 0.0
        for line in proc.stdout:
            if not line.startswith("{") or "val_accuracy" not in (d := json.loads(line)):
                continue
            seen, score = seen + 1, d["val_accuracy"]
            trial.set_user_attr("epochs", seen)
            trial.report(score, d["epoch"])
            if trial.should_prune():
                proc.kill()
                proc.wait()
                raise optuna.TrialPruned()
        proc.wait()
        return score

    s.optimize(objective, n_trials=n, n_jobs=1)


def plain_arm(tmp: Path, a) -> dict:
    storage = f"sqlite:///{tmp / 'plain.db'}"
    optuna.create_study(study_name="plain", storage=storage, direction="maximize", pruner=pruner())
    shares = [a.trials // 2 + (k < a.trials % 2) for k in range(2)]
    wall = run_processes(plain_process, [(storage, n, a.seed + k, a.trials, a.epochs, str(tmp / "space.yaml"))
                                         for k, n in enumerate(shares)])
    done = optuna.load_study(study_name="plain", storage=storage).trials
    return {"wall": wall, "epochs": sum(t.user_attrs.get("epochs", 0) for t in done),
            "pruned": sum(t.state.name == "PRUNED" for t in done),
            "best": max(t.value for t in done if t.state.name == "COMPLETE")}


def gpuflow_arm(tmp: Path, a, api: dict) -> dict:
    folder = fresh(tmp, "gpuflow")
    client(folder).search_experiments()
    opts = dict(trials=a.trials, epochs=a.epochs, pruner="median")
    wall, _ = run(sweep_cmd(folder, a, **opts), cwd=folder, **api)
    runs = trial_runs(folder)
    epochs = sum(len(client(folder).get_metric_history(r.info.run_id, "val_accuracy")) for r in runs)
    s = study(folder)
    return {"wall": wall, "epochs": epochs, "pruned": sum(t.state.name == "PRUNED" for t in s.trials),
            "best": s.best_value}


def table(res: dict, a) -> str:
    total = a.trials * a.epochs
    g, p = res["gpuflow"], res["plain"]
    saved = {k: 1 - v["epochs"] / total for k, v in res.items()}
    ratio = saved["gpuflow"] / saved["plain"] if saved["plain"] > 0 else float("nan")
    gap = (p["best"] - g["best"]) / p["best"]  # how much worse gpuflow's best is (negative: better)
    return "\n".join([
        "| goal | measured | met? |", "|---|---|---|",
        f"| epochs saved by gpuflow >= {SAVED_GOAL:.0%} of the plain pruner's | {ratio:.2f} ({saved['gpuflow']:.0%} vs "
        f"{saved['plain']:.0%} of {total}) | {'yes' if ratio >= SAVED_GOAL else 'no'} |",
        f"| best no more than {SCORE_GOAL:.1%} below the plain arm's | {g['best']:.4f} vs {p['best']:.4f} "
        f"({-gap:+.2%}) | "
        f"{'yes' if gap <= SCORE_GOAL else 'no'} |", "",
        "| arm | epochs trained | trials pruned | best val_accuracy | wall s |", "|---|---|---|---|---|",
        *(f"| {label} | {res[k]['epochs']} | {res[k]['pruned']} | {res[k]['best']:.4f} | {res[k]['wall']:.1f} |"
          for k, label in (("gpuflow", "`gpuflow sweep --pruner median --parallel 2`"),
                           ("plain", "two plain Optuna processes, MedianPruner, bare script")))])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--seed", type=int, default=1, help="the TPE sampler's")
    p.add_argument("--write", action="store_true", help="append a dated section to bench/RESULTS.md")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "space.yaml").write_text(SPACE)
        (tmp / "prefect-home").mkdir()
        server, url = prefect_server(tmp / "prefect-home")
        with server:
            res = {"gpuflow": gpuflow_arm(tmp, a, {"PREFECT_API_URL": url}), "plain": plain_arm(tmp, a)}
    text = table(res, a)
    print(text)
    if a.write:
        cmd = f"python -m bench.prune --trials {a.trials} --epochs {a.epochs}"
        with open(ROOT / "bench" / "RESULTS.md", "a") as f:
            f.write(f"\n## Pruning on short epochs ({datetime.date.today()})\n\n"
                    + textwrap.fill(f"Command: `{cmd}`. {a.trials} trials of {a.epochs} digits epochs, two at a "
                                    "time, on this machine's 2 cores.", 95) + f"\n\n{text}\n")
    return res


if __name__ == "__main__":
    main()
