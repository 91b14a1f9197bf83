"""A user's own torchrun script under the train-script flow vs the same script under bare torchrun.

The script is bench/bare_ddp.py (the seeds' DDP loop), unchanged, sized so that its bare run
takes at least 30 s: `torchrun --standalone --nproc_per_node=2 bench/bare_ddp.py ...` against
`gpuflow run --script bench/bare_ddp.py --cpu-processes 2 -- ...` with the Prefect API on a
`prefect server` already running on loopback. Each repeat runs both back to back (alternating
which goes first). Goal (issue 17): pipeline / bare <= 1.10; the fixed cost in seconds is
reported beside it, with the floor that any gpuflow flow pays: an empty Prefect flow run
that opens and ends one MLflow run in the same store (bench/noop_flow.py --mlflow), timed
in the same repeats. Fixed cost - floor is what running a script adds on top of it.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.common import PY, ROOT, TORCHRUN, env, interleaved, run, summary
from tests.servers import prefect_server

GOAL = 1.10
MIN_BARE_S = 30.0
SCRIPT = ROOT / "bench" / "bare_ddp.py"


def script_args(a) -> list[str]:
    return ["--dataset", "synthetic", "--synthetic-size", str(a.size), "--epochs", str(a.epochs)]


def bare(a) -> float:
    return run([*TORCHRUN, "--nproc_per_node=2", str(SCRIPT), *script_args(a)])[0]


def pipeline(tmp: Path, a, api_url: str) -> float:
    wall, _ = run([PY, "-m", "gpuflow.flows", "run", "--script", str(SCRIPT), "--cpu-processes", "2",
                   "--runs-dir", str(tmp / "runs"), "--tracking-uri", f"sqlite:///{tmp / 'mlflow.db'}",
                   "--", *script_args(a)], cwd=tmp, PREFECT_API_URL=api_url, PREFECT_HOME=str(tmp / "prefect-home"))
    return wall


def floor(tmp: Path, api_url: str) -> float:
    """An empty flow run with one task that opens and ends one MLflow run in the same store."""
    return run([PY, "-m", "bench.noop_flow", "--mlflow", f"sqlite:///{tmp / 'mlflow.db'}", "--runs-dir",
                str(tmp / "floor-runs")], cwd=ROOT, PREFECT_API_URL=api_url,
               PREFECT_HOME=str(tmp / "prefect-home"))[0]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--size", type=int, default=120_000, help="synthetic samples (bare run >= 30 s on 2 cores)")
    p.add_argument("--epochs", type=int, default=3)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "server-home").mkdir()
        server, url = prefect_server(tmp / "server-home", env())
        with server:
            pipeline(tmp, argparse.Namespace(size=2048, epochs=1), url)  # the first run creates mlflow.db
            walls = interleaved(a.repeats, {"bare": lambda: bare(a), "pipeline": lambda: pipeline(tmp, a, url),
                                            "floor": lambda: floor(tmp, url)})
    fixed = [s - b for s, b in zip(walls["pipeline"], walls["bare"], strict=True)]
    paired = {"fixed_s": summary(fixed),
              "ratio": summary([s / b for s, b in zip(walls["pipeline"], walls["bare"], strict=True)]),
              "script_path_s": summary([f - fl for f, fl in zip(fixed, walls["floor"], strict=True)])}
    return {"args": vars(a), "walls": {k: summary(v) for k, v in walls.items()}, "paired": paired}


def goals(res: dict) -> list[tuple[str, str, str]]:
    w, pr = res["walls"], res["paired"]
    rt, fx = pr["ratio"], pr["fixed_s"]
    long_enough = w["bare"]["min"] >= MIN_BARE_S
    met = "yes" if rt["median"] <= GOAL else ("within noise" if rt["min"] <= GOAL else "no")
    if met == "no" and w["floor"]["median"] > (GOAL - 1) * MIN_BARE_S:
        met += (f": the floor alone ({w['floor']['median']:.1f} s) is over {GOAL - 1:.0%} of a "
                f"{MIN_BARE_S:.0f} s run; <= {GOAL} holds from a bare run of {fx['median'] / (GOAL - 1):.0f} s")
    return [(f"your script: pipeline / bare torchrun <= {GOAL} (bare run >= {MIN_BARE_S:.0f} s, running server)",
             f"{rt['median']:.3f} ({rt['min']:.3f}-{rt['max']:.3f}); fixed cost {fx['median']:+.1f} s "
             f"({fx['min']:+.1f} to {fx['max']:+.1f}); pipeline {w['pipeline']['median']:.1f} s, "
             f"bare {w['bare']['median']:.1f} s", met if long_enough else f"{met} (but a bare run took under "
             f"{MIN_BARE_S:.0f} s: raise --size)")]


def table(res: dict) -> str:
    a = res["args"]
    rows = [f"Script: bench/bare_ddp.py (the seeds' DDP loop, unchanged), synthetic {a['size']} samples, "
            f"{a['epochs']} epochs, 2 gloo processes; {res['paired']['ratio']['n']} "
            "repeats, each pair back to back.", "",
            "| goal | measured: median (min-max) over repeats | met? |", "|---|---|---|"]
    rows += [f"| {g} | {m} | {ok} |" for g, m, ok in goals(res)]
    rows += ["", "| job | wall s, median (min-max) |", "|---|---|"]
    rows += [f"| {k} | {v['median']:.1f} ({v['min']:.1f}-{v['max']:.1f}) |" for k, v in res["walls"].items()]
    sp = res["paired"]["script_path_s"]
    rows += ["", "floor: an empty Prefect flow run with one task that opens and ends one MLflow run in the same "
             "store (`python -m bench.noop_flow --mlflow ...`), the least any gpuflow flow costs. The script path "
             f"adds {sp['median']:+.1f} s ({sp['min']:+.1f} to {sp['max']:+.1f}) on top of it (fixed cost - floor, "
             "paired per repeat)."]
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(main()))
