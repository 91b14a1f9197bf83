"""Orchestration overhead: the whole pipeline (`gpuflow run`) vs the bare script, same job.

Default job: `gpuflow run`'s defaults (mlp on digits, 3 epochs, DDP over gloo with 2 processes
on this CPU host) against bench/bare_ddp.py under torchrun. Pipeline = probe, assign, data,
preflight, MLflow run, launch, log results and registration, with the Prefect API on a
`prefect server` already running on loopback (the goals' mode), or ephemeral (started by the
run; information only).

Goals, as users feel them, on the running server: the fixed overhead (pipeline wall - bare
wall) <= 4 s for the default job, and pipeline / bare <= 1.05 for a job whose bare run takes
at least a minute (`--dataset synthetic --size N`, N sized for that; see bench/run_all.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench.common import PY, ROOT, TORCHRUN, env, fmt, run, summary
from tests.servers import prefect_server

FIXED_GOAL_S = 4.0  # pipeline - bare, default job
RATIO_GOAL = 1.05   # pipeline / bare, a job whose bare run takes >= LONG_BARE_S
LONG_BARE_S = 60.0
MODES = ("ephemeral", "server")


def job_args(a, epochs: int | None = None) -> list[str]:
    return ["--dataset", a.dataset, "--synthetic-size", str(a.size), "--epochs", str(epochs or a.epochs)]


def is_default_job(args: dict) -> bool:
    return args["dataset"] == "digits" and args["epochs"] == 3


def bare(a) -> float:
    wall, _ = run([*TORCHRUN, "--nproc_per_node=2", str(ROOT / "bench" / "bare_ddp.py"), *job_args(a)])
    return wall


def last_json(out: str) -> dict:
    """The summary `gpuflow run` prints last (indented JSON, its first line a lone '{')."""
    start = 0 if out.startswith("{\n") else out.rindex("\n{\n") + 1
    return json.loads(out[start:])


def pipeline(tmp: Path, a, api_url: str | None, epochs: int | None = None) -> tuple[float, dict]:
    extra = {"PREFECT_HOME": str(tmp / "prefect-home"),
             "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}
    if api_url:
        extra["PREFECT_API_URL"] = api_url
    wall, out = run([PY, "-m", "gpuflow.flows", "run", *job_args(a, epochs), "--runs-dir", str(tmp / "runs"),
                     "--tracking-uri", f"sqlite:///{tmp / 'mlflow.db'}"], cwd=tmp, **extra)
    return wall, last_json(out)["timings"]


def floor(tmp: Path, api_url: str) -> float:
    """An empty flow run with one task on the same server: what Prefect alone costs."""
    wall, _ = run([PY, "-m", "bench.noop_flow"], cwd=ROOT, PREFECT_API_URL=api_url,
                  PREFECT_HOME=str(tmp / "prefect-home"))
    return wall


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--dataset", default="digits")
    p.add_argument("--size", type=int, default=4096, help="samples, for --dataset synthetic")
    p.add_argument("--modes", default=",".join(MODES),
                   help="Prefect API modes to time: ephemeral, server or both (the goals use server)")
    p.add_argument("--first-epochs", type=int, help="epochs of the first run in each mode's fresh folder "
                   "(default: --epochs; a long job can warm up with 1)")
    a = p.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    assert set(modes) <= set(MODES) and "server" in modes, f"--modes: server, optionally ephemeral; got {modes}"
    walls: dict[str, list[float]] = {"bare": [], "floor": [], **{m: [] for m in modes}}
    steps: dict[str, list[dict]] = {m: [] for m in modes}
    first: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "server-home").mkdir()
        server, url = prefect_server(tmp / "server-home", env())
        with server:
            startup = server.startup_s
            apis = {"ephemeral": None, "server": url}
            # Each mode keeps its folder (mlflow.db, data/, runs/) across its runs, as a user's
            # checkout does. Its first run also creates the MLflow schema and the prepared
            # dataset: timed apart, as "first run".
            for mode in modes:
                (tmp / mode).mkdir()
                first[mode], _ = pipeline(tmp / mode, a, apis[mode], a.first_epochs)
            for i in range(a.repeats):
                walls["bare"].append(bare(a))
                (tmp / f"floor-{i}").mkdir()
                walls["floor"].append(floor(tmp / f"floor-{i}", url))
                for mode in modes:
                    wall, timings = pipeline(tmp / mode, a, apis[mode])
                    walls[mode].append(wall)
                    steps[mode].append(timings)
                print({k: round(v[-1], 1) for k, v in walls.items()}, flush=True)
    # each repeat's pipeline against the bare run just before it: drifts of the machine cancel
    paired = {"fixed_s": summary([s - b for s, b in zip(walls["server"], walls["bare"], strict=True)]),
              "ratio": summary([s / b for s, b in zip(walls["server"], walls["bare"], strict=True)])}
    return {"args": vars(a), "server_startup_s": startup, "first_run_s": first,
            "walls": {k: summary(v) for k, v in walls.items()}, "paired": paired, "steps": steps}


def _met(q: dict, goal: float) -> str:
    return "yes" if q["median"] <= goal else ("within noise" if q["min"] <= goal else "no")


def goals(res: dict) -> list[tuple[str, str, str]]:
    """(goal, measured, met?) for the running-server mode; the summary in RESULTS.md uses these."""
    w, a = res["walls"], res["args"]
    b, s = w["bare"]["median"], w["server"]["median"]
    pr = res.get("paired") or {"fixed_s": summary([s - b]), "ratio": summary([s / b])}
    fx, rt = pr["fixed_s"], pr["ratio"]
    fixed = f"{fx['median']:+.1f} s ({fx['min']:+.1f} to {fx['max']:+.1f}); pipeline {s:.1f} s, bare {b:.1f} s"
    ratio = f"{rt['median']:.3f} ({rt['min']:.3f}-{rt['max']:.3f}); pipeline {s:.1f} s, bare {b:.1f} s"
    rows = []
    if is_default_job(a):
        rows.append((f"fixed overhead, pipeline - bare <= {FIXED_GOAL_S:.0f} s (default job, running server)",
                     fixed, _met(fx, FIXED_GOAL_S)))
    else:
        met = (_met(rt, RATIO_GOAL) if b >= LONG_BARE_S
               else f"not judged: the bare run took {b:.0f} s, under the goal's {LONG_BARE_S:.0f} s")
        rows.append((f"pipeline / bare <= {RATIO_GOAL} (bare run >= {LONG_BARE_S:.0f} s, running server)",
                     ratio, met))
        rows.append(("(information) fixed overhead, pipeline - bare, on that job", fixed, ""))
    return rows


def table(res: dict) -> str:
    b = res["walls"]["bare"]["median"]
    a = res["args"]
    job = a["dataset"] + (f" ({a['size']} samples)" if a["dataset"] == "synthetic" else "")
    modes = [m for m in MODES if m in res["walls"]]
    rows = [(f"Job: mlp on {job}, {a['epochs']} epochs, DDP 2 x gloo; {a['repeats']} repeats; "
             f"prefect server became healthy in {res['server_startup_s']:.1f} s. Pipeline rows are later "
             "runs in the same folder (existing mlflow.db and prepared dataset), as a user's repeated "
             "or scheduled runs are."), "",
            ("| goal (running Prefect server) | measured: median (min-max) over repeats, each pipeline "
             "run against the bare run before it | met? |"), "|---|---|---|",
            *(f"| {g} | {m} | {ok} |" for g, m, ok in goals(res)), "",
            "| job | wall s, median (min-max) | - bare, s | / bare |", "|---|---|---|---|",
            f"| bare torchrun script | {fmt(res['walls']['bare'], 1)} | | 1.00 |"]
    labels = {"ephemeral": "pipeline, ephemeral Prefect API (information: `make run` without a server)",
              "server": "pipeline, running Prefect server (the goals)"}
    for mode in modes:
        w = res["walls"][mode]
        rows.append(f"| {labels[mode]} | {fmt(w, 1)} | {w['median'] - b:+.1f} | {w['median'] / b:.2f} |")
    fe = a.get("first_epochs")
    for mode, f in res.get("first_run_s", {}).items():
        what = f" ({fe} epoch{'s' if fe > 1 else ''})" if fe and fe != a["epochs"] else ""
        rows.append(f"| first run in a fresh folder{what}, {mode} (creates mlflow.db and the prepared "
                    f"dataset) | {f:.1f} | | |")
    if res["walls"].get("floor"):
        f = res["walls"]["floor"]
        rows += [f"| empty Prefect flow + 1 task on the running server (the floor) | {fmt(f, 1)} | | |",
                 (f"| bare script + that floor (a Prefect-run launch that overlapped nothing) | "
                  f"{b + f['median']:.1f} | {f['median']:+.1f} | {(b + f['median']) / b:.2f} |")]
    names = list(res["steps"]["server"][0])
    rows += ["", "Per-step seconds (median over repeats), measured inside the flow:", "",
             "| mode | " + " | ".join(names) + " | outside steps (process start, imports, API) |",
             "|---" * (len(names) + 2) + "|"]
    for mode in modes:
        med = {n: statistics.median(s[n] for s in res["steps"][mode]) for n in names}
        outside = res["walls"][mode]["median"] - sum(med.values())
        rows.append(f"| {mode} | " + " | ".join(f"{med[n]:.2f}" for n in names) + f" | {outside:.1f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(main()))
