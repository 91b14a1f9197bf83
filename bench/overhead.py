"""Orchestration overhead: the whole pipeline vs the bare script for the same small job.

Job: the default (mlp on digits, 3 epochs, DDP over gloo with 2 processes on this CPU host).
Pipeline = probe, assign, data, MLflow run, launch, logging, registration, with the Prefect
API either ephemeral (started by the run) or a `prefect server` already running on loopback.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench.common import PY, ROOT, TORCHRUN, env, fmt, run, summary
from tests.servers import prefect_server


def job_args(a) -> list[str]:
    return ["--dataset", a.dataset, "--synthetic-size", str(a.size), "--epochs", str(a.epochs)]


def bare(a) -> float:
    wall, _ = run([*TORCHRUN, "--nproc_per_node=2", str(ROOT / "bench" / "bare_ddp.py"), *job_args(a)])
    return wall


def pipeline(tmp: Path, a, api_url: str | None) -> tuple[float, dict]:
    extra = {"PREFECT_HOME": str(tmp / "prefect-home"),
             "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}
    if api_url:
        extra["PREFECT_API_URL"] = api_url
    wall, out = run([PY, "-m", "gpuflow.flows.train", *job_args(a), "--runs-dir", str(tmp / "runs"),
                     "--tracking-uri", f"sqlite:///{tmp / 'mlflow.db'}"], cwd=tmp, **extra)
    summary_json = json.loads(out[out.index("{"):out.rindex("}") + 1])
    return wall, summary_json["timings"]


def floor(tmp: Path, api_url: str) -> float:
    """An empty flow run with one task on the same server: what Prefect alone costs."""
    wall, _ = run([PY, "-m", "bench.noop_flow"], cwd=ROOT, PREFECT_API_URL=api_url,
                  PREFECT_HOME=str(tmp / "prefect-home"))
    return wall


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--dataset", default="digits")
    p.add_argument("--size", type=int, default=4096, help="samples, for --dataset synthetic")
    a = p.parse_args(argv)
    walls: dict[str, list[float]] = {"bare": [], "ephemeral": [], "server": [], "floor": []}
    steps: dict[str, list[dict]] = {"ephemeral": [], "server": []}
    first: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "server-home").mkdir()
        server, url = prefect_server(tmp / "server-home", env())
        with server:
            startup = server.startup_s
            modes = (("ephemeral", None), ("server", url))
            # Each mode keeps its folder (mlflow.db, data/, runs/) across its runs, as a user's
            # checkout does. Its first run also creates the MLflow schema and the prepared
            # dataset: timed apart, as "first run".
            for mode, api in modes:
                (tmp / mode).mkdir()
                first[mode], _ = pipeline(tmp / mode, a, api)
            for i in range(a.repeats):
                walls["bare"].append(bare(a))
                (tmp / f"floor-{i}").mkdir()
                walls["floor"].append(floor(tmp / f"floor-{i}", url))
                for mode, api in modes:
                    wall, timings = pipeline(tmp / mode, a, api)
                    walls[mode].append(wall)
                    steps[mode].append(timings)
                print({k: round(v[-1], 1) for k, v in walls.items()}, flush=True)
    return {"args": vars(a), "server_startup_s": startup, "first_run_s": first,
            "walls": {k: summary(v) for k, v in walls.items()}, "steps": steps}


def table(res: dict) -> str:
    b = res["walls"]["bare"]["median"]
    a = res["args"]
    job = a["dataset"] + (f" ({a['size']} samples)" if a["dataset"] == "synthetic" else "")
    rows = [f"Job: mlp on {job}, {a['epochs']} epochs, DDP 2 x gloo; {a['repeats']} repeats; "
            f"prefect server became healthy in {res['server_startup_s']:.1f} s. Pipeline rows are later runs "
            "in the same folder (existing mlflow.db and prepared dataset), as a user's repeated or "
            "scheduled runs are.", "", "| job | wall s, median (min-max) | / bare |", "|---|---|---|",
            f"| bare torchrun script | {fmt(res['walls']['bare'], 1)} | 1.00 |"]
    for mode, label in (("ephemeral", "pipeline, ephemeral Prefect API"),
                        ("server", "pipeline, running Prefect server (goal <= 1.3)")):
        w = res["walls"][mode]
        rows.append(f"| {label} | {fmt(w, 1)} | {w['median'] / b:.2f} |")
    for mode, f in res.get("first_run_s", {}).items():
        rows.append(f"| first run in a fresh folder, {mode} (creates mlflow.db and the prepared dataset) "
                    f"| {f:.1f} | {f / b:.2f} |")
    if res["walls"].get("floor"):
        f = res["walls"]["floor"]
        rows += [f"| empty Prefect flow + 1 task on the running server (the floor) | {fmt(f, 1)} | "
                 f"{f['median'] / b:.2f} |",
                 f"| bare script + that floor (a Prefect-run launch that overlapped nothing) | "
                 f"{b + f['median']:.1f} | {(b + f['median']) / b:.2f} |"]
    names = list(res["steps"]["server"][0])
    rows += ["", "Per-step seconds (median over repeats), measured inside the flow:", "",
             "| step | " + " | ".join(names) + " | outside steps (process start, imports, API) |",
             "|---" * (len(names) + 2) + "|"]
    import statistics

    for mode in ("ephemeral", "server"):
        med = {n: statistics.median(s[n] for s in res["steps"][mode]) for n in names}
        outside = res["walls"][mode]["median"] - sum(med.values())
        rows.append(f"| {mode} | " + " | ".join(f"{med[n]:.2f}" for n in names) + f" | {outside:.1f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(main()))
