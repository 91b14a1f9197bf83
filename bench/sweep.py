"""Sweeps: `gpuflow sweep` against plain Optuna loops running the bare script; pruning; a crash.

The same search everywhere: mlp on digits, TPE (seeded, constant liar, gpuflow's startup
trials), no pruner, `--trials` trials of `--epochs` epochs over lr (log float) and optimizer
(tests/test_sweep.py's space), one process per trial, a Prefect server already running.

 1. `gpuflow sweep --parallel 2 --gpus cpu` against (a) one Optuna process (study.optimize,
    n_jobs=1) whose objective runs bench/bare_ddp.py in a subprocess, one trial at a time, goal
    sweep <= 0.6 x its wall; (b) two Optuna processes on one SQLite study (the second seeded
    seed + 1, else both draw the same values), each running half the trials, goal <= 1.10 x;
    (c) with `--ray PYTHON` (a Python with Ray Tune installed, not a gpuflow dependency), Ray Tune
    with the same TPE sampler through its OptunaSearch, 2 trials at a time, no scheduler
    (bench/ray_tune.py), each trial the bare script in a subprocess as above, and (d) each trial's
    loop in Ray's own worker (Ray's way: workers reused, torch imported once each); goal sweep
    <= 1.0 x.
 2. The sweep's slot utilisation: sum of its trial runs' MLflow durations / (2 slots x wall).
 3. The sweep with `--pruner median` vs `--pruner none` on longer epochs (synthetic data, epochs
    longer than the metrics relay's poll): epochs trained (val_accuracy points of the trial runs)
    at least 30% fewer, best score within 1% (relative) of the unpruned search.
 4. kill -9 of the sweep once half its budget is COMPLETE (a trial training), then the same
    command again: trials lost, zombies (RUNNING trials or MLflow runs), duplicates; goal 0, 0, 0.

    python -m bench.sweep [--repeats 2] [--trials 8] [--epochs 2] [--ray PYTHON] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import logging
import multiprocessing
import os
import signal
import statistics
import subprocess
import tempfile
import textwrap
import time
from collections import Counter
from pathlib import Path

import optuna
import psutil

from bench.common import PY, ROOT, env, fmt, interleaved, json_lines, launcher, run, summary
from tests.servers import prefect_server

SPACE = "lr: {type: float, low: 1.0e-3, high: 0.1, log: true}\noptimizer: {type: choice, values: [adam, sgd]}\n"
BARE = ROOT / "bench" / "bare_ddp.py"
SLOTS = 2  # --parallel 2: one CPU slot (one process) per trial
LOOP_GOAL, PAIR_GOAL, RAY_GOAL, SAVED_GOAL, SCORE_GOAL = 0.6, 1.10, 1.0, 0.30, 0.01
RAY_ARMS = {"ray": "bare script", "ray_own": "the loop in Ray's worker"}  # bench/ray_tune.py, with --ray
optuna.logging.set_verbosity(optuna.logging.WARNING)  # here and in the Optuna processes


def sampler(seed: int, trials: int):
    """gpuflow's (flows/study.py open_study): only the way trials are launched differs."""
    return optuna.samplers.TPESampler(seed=seed, constant_liar=True, n_startup_trials=min(10, max(2, trials // 3)))


def optuna_process(storage: str, study: str, n: int, seed: int, trials: int, epochs: int, space: str) -> None:
    """A plain Optuna process: n trials, each the bare script in a subprocess (one process)."""
    from gpuflow.flows.space import read_space

    dists = read_space(space)
    s = optuna.load_study(study_name=study, storage=storage, sampler=sampler(seed, trials))

    def objective(trial) -> float:
        v = {name: d.suggest(trial, name) for name, d in dists.items()}
        _, out = run([*launcher(1), str(BARE), "--dataset", "digits", "--epochs", str(epochs), "--val",
                      "--lr", str(v["lr"]), "--optimizer", v["optimizer"]])
        return json_lines(out)[-1]["val_accuracy"]

    s.optimize(objective, n_trials=n, n_jobs=1)


def run_processes(target, each: list[tuple]) -> float:
    """Seconds for one spawned process per argument tuple of `each`, all running at once."""
    spawn = multiprocessing.get_context("spawn")
    procs = [spawn.Process(target=target, args=args) for args in each]
    start = time.perf_counter()
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    wall = time.perf_counter() - start
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return wall


def optuna_arm(tmp: Path, a, processes: int) -> tuple[float, dict]:
    """Wall of `processes` Optuna processes sharing one SQLite study, `a.trials` trials in all."""
    storage = f"sqlite:///{tmp / 'optuna.db'}"
    optuna.create_study(study_name="plain", storage=storage, direction="maximize")
    shares = [a.trials // processes + (k < a.trials % processes) for k in range(processes)]
    wall = run_processes(optuna_process, [(storage, "plain", n, a.seed + k, a.trials, a.epochs,
                                           str(tmp.parent / "space.yaml")) for k, n in enumerate(shares)])
    done = optuna.load_study(study_name="plain", storage=storage).get_trials(deepcopy=False)
    busy = sum((t.datetime_complete - t.datetime_start).total_seconds() for t in done)
    return wall, {"busy": busy / (SLOTS * wall), "best": max(t.value for t in done)}


def ray_arm(tmp: Path, a, in_process: bool) -> tuple[float, dict]:
    """Wall of Ray Tune running the same trials (bench/ray_tune.py, in `a.ray`, the Python that has Ray)."""
    start = time.perf_counter()
    out = subprocess.run([a.ray, "-m", "bench.ray_tune", "--space", str(tmp.parent / "space.yaml"), "--storage",
                          str(tmp / "ray"), "--python", PY, "--trials", str(a.trials), "--epochs", str(a.epochs),
                          "--seed", str(a.seed), *(["--in-process"] if in_process else [])],
                         cwd=ROOT, env=env(), capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - start
    if out.returncode != 0:
        raise RuntimeError(f"the Ray Tune arm failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    got = json_lines(out.stdout)[-1]
    return wall, {"busy": got["trial_s"] / (SLOTS * wall), "best": got["best"]}


def sweep_cmd(tmp: Path, a, **opts) -> list[str]:
    base = {"space": tmp.parent / "space.yaml", "trials": a.trials, "parallel": SLOTS, "gpus": "cpu",
            "model": "mlp", "dataset": "digits", "epochs": a.epochs, "study": "s", "sampler_seed": a.seed,
            "pruner": "none", "tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}",
            "storage": f"sqlite:///{tmp / 'optuna.db'}", "runs_dir": tmp / "runs", "registered_model": "bench"}
    return [PY, "-m", "gpuflow.flows", "sweep",
            *(x for k, v in (base | opts).items() for x in (f"--{k.replace('_', '-')}", str(v)))]


def fresh(tmp: Path, name: str) -> Path:
    (tmp / name).mkdir()
    return tmp / name


def client(folder: Path):
    """The folder's MLflow store, created on first use (before a sweep: as in a user's checkout, not timed)."""
    import mlflow

    logging.getLogger("mlflow").setLevel(logging.WARNING)  # "Creating initial MLflow database tables..."
    return mlflow.MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")


def all_runs(folder: Path) -> list:
    c = client(folder)
    return c.search_runs([e.experiment_id for e in c.search_experiments()])


def trial_runs(folder: Path) -> list:
    return [r for r in all_runs(folder) if "mlflow.parentRunId" in r.data.tags]


def study(folder: Path):
    return optuna.load_study(study_name="s", storage=f"sqlite:///{folder / 'optuna.db'}")


def sweep_arm(folder: Path, a, api: dict, **opts) -> tuple[float, dict]:
    client(folder).search_experiments()
    wall, _ = run(sweep_cmd(folder, a, **opts), cwd=folder, **api)
    runs = trial_runs(folder)
    busy = sum(r.info.end_time - r.info.start_time for r in runs) / 1000
    return wall, {"busy": busy / (SLOTS * wall), "best": study(folder).best_value}


def pruning(tmp: Path, a, api: dict) -> dict:
    """The same sweep with the median pruner and without: epochs trained, best score, wall."""
    out = {}
    for pruner in ("median", "none"):
        folder = fresh(tmp, f"prune-{pruner}")
        wall, res = sweep_arm(folder, a, api, pruner=pruner, dataset="synthetic", synthetic_size=a.prune_size,
                              epochs=a.prune_epochs)
        epochs = sum(len(client(folder).get_metric_history(r.info.run_id, "val_accuracy"))
                     for r in trial_runs(folder))
        pruned = sum(t.state.name == "PRUNED" for t in study(folder).trials)
        out[pruner] = {"wall": wall, "epochs": epochs, "best": res["best"], "pruned": pruned}
    return out


def crash(tmp: Path, a, api: dict) -> dict:
    """kill -9 once half the budget is COMPLETE and a trial is training; the same command again."""
    folder = fresh(tmp, "crash")
    client(folder).search_experiments()
    proc = subprocess.Popen(sweep_cmd(folder, a), cwd=folder, env=env(**api), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the sweep ended before half its budget"
        try:
            trials = study(folder).trials
        except KeyError:  # not created yet
            trials = []
        complete = {t.number: t.value for t in trials if t.state.name == "COMPLETE"}
        if len(complete) >= a.trials // 2 and any(t.state.name == "RUNNING" and "mlflow_run_id" in t.user_attrs
                                                  for t in trials):
            break
        time.sleep(0.3)
    tree = psutil.Process(proc.pid).children(recursive=True)  # its trials' processes
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(10)
    strays = [c for c in tree if c.is_running()]
    for c in strays:
        c.kill()
    restart, _ = run(sweep_cmd(folder, a), cwd=folder, **api)
    s, runs = study(folder), trial_runs(folder)
    finished = [r for r in runs if r.info.status == "FINISHED"]
    per_trial = Counter(r.data.tags["sweep.trial"] for r in finished)
    kept = {t.number: t.value for t in s.trials if t.state.name == "COMPLETE"}
    lost = sum(kept.get(n) != v or str(n) not in per_trial for n, v in complete.items())
    zombies = (sum(t.state.name == "RUNNING" for t in s.trials)
               + sum(r.info.status == "RUNNING" for r in all_runs(folder)))
    dupes = sum(n - 1 for n in per_trial.values()) + max(0, len(kept) - a.trials)
    return {"lost": lost, "zombies": zombies, "duplicates": dupes, "strays": len(strays), "restart_s": restart,
            "cut_off": sum("cut_off" in t.user_attrs for t in s.trials), "complete_at_kill": len(complete),
            "killed_runs": sum(r.info.status == "KILLED" for r in runs)}


def beside() -> tuple[float, int]:
    """The 1-minute load and the pytest processes on the machine (a test run beside the benchmark)."""
    tests = [p for p in psutil.process_iter(["cmdline"]) if "pytest" in " ".join(p.info["cmdline"] or [])]
    return os.getloadavg()[0], len(tests)


def _met(q: dict, goal: float) -> str:
    return "yes" if q["median"] <= goal else ("within noise" if q["min"] <= goal else "no")


def table(res: dict) -> str:
    w, d, p, c = res["walls"], res["details"], res["pruning"], res["crash"]
    med = {k: statistics.median(v) for k, v in w.items()}
    ratio = {k: summary([s / b for s, b in zip(w["sweep"], w[k], strict=True)]) for k in w if k != "sweep"}
    busy = {k: statistics.median(x["busy"] for x in v) for k, v in d.items()}
    saved = 1 - p["median"]["epochs"] / p["none"]["epochs"]
    gap = 1 - p["median"]["best"] / p["none"]["best"]
    zero = c["lost"] == c["zombies"] == c["duplicates"] == 0
    r = {k: f"{q['median']:.2f} ({q['min']:.2f}-{q['max']:.2f})" for k, q in ratio.items()}
    return "\n".join([
        "| goal | measured | met? |", "|---|---|---|",
        f"| sweep / one Optuna loop <= {LOOP_GOAL} | {r['loop']}; {med['sweep']:.1f} s vs {med['loop']:.1f} s | "
        f"{_met(ratio['loop'], LOOP_GOAL)} |",
        f"| sweep / two Optuna processes on one study <= {PAIR_GOAL} | {r['pair']}; {med['sweep']:.1f} s vs "
        f"{med['pair']:.1f} s | {_met(ratio['pair'], PAIR_GOAL)} |",
        *(f"| sweep / Ray Tune (same sampler, no scheduler), {how} <= {RAY_GOAL} | {r[k]}; {med['sweep']:.1f} s vs "
          f"{med[k]:.1f} s | {_met(ratio[k], RAY_GOAL)} |" for k, how in RAY_ARMS.items() if k in w),
        f"| (information) sweep's slot utilisation, trial runs / ({SLOTS} slots x wall) | {busy['sweep']:.0%} | |",
        f"| pruning: >= {SAVED_GOAL:.0%} fewer epochs | {saved:.0%} ({p['median']['epochs']} vs "
        f"{p['none']['epochs']} epochs, {p['median']['pruned']} trials pruned) | "
        f"{'yes' if saved >= SAVED_GOAL else 'no'} |",
        f"| pruning: best within {SCORE_GOAL:.0%} of unpruned | {p['median']['best']:.4f} vs {p['none']['best']:.4f} "
        f"({-gap:+.1%}) | {'yes' if gap <= SCORE_GOAL else 'no'} |",
        f"| kill -9 at half the budget, restart: lost, zombies, duplicates = 0, 0, 0 | {c['lost']}, {c['zombies']}, "
        f"{c['duplicates']} | {'yes' if zero else 'no'} |", "",
        "| arm | wall s, median (min-max) | best val_accuracy | busy: trial time / (2 cores x wall) |",
        "|---|---|---|---|",
        *(f"| {label} | {fmt(summary(w[k]), 1)} | {statistics.median(x['best'] for x in d[k]):.4f} | {busy[k]:.0%} |"
          for k, label in (("sweep", "`gpuflow sweep --parallel 2`"), ("loop", "one Optuna loop, bare script"),
                           ("pair", "two Optuna processes, one SQLite study, bare script"),
                           *((k, f"Ray Tune, OptunaSearch, 2 at a time, {how}") for k, how in RAY_ARMS.items()))
          if k in w),
        *(f"| pruner {k}: synthetic {res['args']['prune_size']}, {res['args']['prune_epochs']} epochs | "
          f"{v['wall']:.1f} | {v['best']:.4f} | |" for k, v in p.items()), "",
        textwrap.fill(f"Crash: killed with {c['complete_at_kill']} trials COMPLETE; {c['strays']} of its processes "
                      f"left 10 s after the kill; the restart took {c['restart_s']:.1f} s, marked {c['cut_off']} "
                      f"trial(s) cut off and left {c['killed_runs']} trial run(s) KILLED.", 95)])


def intro(a, res: dict, cmd: str) -> str:
    (load0, tests0), (load1, tests1) = res["beside"]
    if tests0 and tests1:
        beside_it = "A CI run was using the cores beside it"
    elif tests0 or tests1:
        beside_it = f"A test run was on the machine only when it {'started' if tests0 else 'ended'}"
    else:
        beside_it = "Nothing else was running on the machine when it started and ended"
    return textwrap.fill(
        f"Command: `{cmd}`. mlp on digits, {a.trials} trials of {a.epochs} epochs, TPE seed {a.seed}, no pruner, "
        f"one process per trial, a Prefect server already running; {a.repeats} repeats of part 1, interleaved. "
        f"{beside_it} ({tests0}/{tests1} pytest processes, 1-minute load {load0:.1f}/{load1:.1f}, before/after).",
        95)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2, help="of part 1 (interleaved); parts 3 and 4 run once")
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--seed", type=int, default=1, help="the TPE sampler's")
    p.add_argument("--prune-epochs", type=int, default=6)
    p.add_argument("--prune-size", type=int, default=50000, help="synthetic samples of the pruning sweeps")
    p.add_argument("--ray", metavar="PYTHON", help="a Python with ray[tune] installed and the project's packages "
                   "importable (a venv whose site-packages holds a .pth line `import site; site.addsitedir('<this "
                   ".venv's site-packages>')`): adds the two Ray Tune arms")
    p.add_argument("--write", action="store_true", help="append a dated section to bench/RESULTS.md")
    a = p.parse_args(argv)
    before = beside()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "space.yaml").write_text(SPACE)
        (tmp / "prefect-home").mkdir()
        server, url = prefect_server(tmp / "prefect-home", env())
        api = {"PREFECT_API_URL": url, "PREFECT_HOME": str(tmp / "prefect-home"),
               "GPUFLOW_LOCK_DIR": str(tmp / "locks")}
        details: dict[str, list[dict]] = {k: [] for k in ("sweep", "loop", "pair", *(RAY_ARMS if a.ray else ()))}

        def arm(name: str, timed):
            def go() -> float:
                wall, info = timed(fresh(tmp, f"{name}-{len(details[name])}"))
                details[name].append(info)
                return wall
            return go

        with server:
            walls = interleaved(a.repeats, {"sweep": arm("sweep", lambda f: sweep_arm(f, a, api)),
                                            "loop": arm("loop", lambda f: optuna_arm(f, a, 1)),
                                            "pair": arm("pair", lambda f: optuna_arm(f, a, 2)),
                                            **({k: arm(k, lambda f, k=k: ray_arm(f, a, k == "ray_own"))
                                                for k in RAY_ARMS} if a.ray else {})})
            res = {"args": vars(a), "walls": walls, "details": details, "pruning": pruning(tmp, a, api),
                   "crash": crash(tmp, a, api), "beside": (before, beside())}
    text = table(res)
    print(text)
    if a.write:
        cmd = "python -m bench.sweep" + "".join(f" --{k.replace('_', '-')} {v}" for k, v in vars(a).items()
                                                if k != "write" and p.get_default(k) != v)
        section = f"\n## Sweeps (#28, {datetime.date.today()}, same machine)\n\n{intro(a, res, cmd)}\n\n{text}\n"
        with open(ROOT / "bench" / "RESULTS.md", "a") as f:
            f.write(section)
        print("appended to bench/RESULTS.md")
    return res


if __name__ == "__main__":
    main()
