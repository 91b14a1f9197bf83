"""How fast a running pipeline stops: Ctrl-C, SIGTERM to the flow, SIGTERM to its process
group, kill -9 of the flow. Goal: every process of the run gone within 15 s of the signal.

    python -m bench.stop --repeats 1

Each run is `gpuflow run` on its defaults (temporary Prefect API), a job long enough to be
stopped in its second epoch. Measured: signal -> flow exited, and signal -> every process of
the run (flow, API, torchrun, ranks) gone; the MLflow run's status after the stop.
"""

from __future__ import annotations

import argparse
import os
import signal
import sqlite3
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from bench.common import PY, env, fmt, summary

GOAL_S = 15.0
HOW = {"ctrl-c (SIGINT to the group)": (signal.SIGINT, True), "SIGTERM to the flow": (signal.SIGTERM, False),
       "SIGTERM to the group": (signal.SIGTERM, True), "kill -9 of the flow": (signal.SIGKILL, False)}


def one(base: Path, sig: int, group: bool) -> dict:
    db = base / "mlflow.db"
    cmd = [PY, "-m", "gpuflow.flows", "run", "--dataset", "synthetic", "--synthetic-size", "60000",
           "--epochs", "50", "--gpus", "cpu", "--tracking-uri", f"sqlite:///{db}", "--runs-dir", str(base / "runs")]
    e = env(PREFECT_HOME=str(base / "ph"))
    e.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen(cmd, cwd=base, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    while not _epoch_logged(db):
        if proc.poll() is not None:
            raise RuntimeError(f"the pipeline exited ({proc.returncode}) before its first epoch")
        time.sleep(0.2)
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    start = time.perf_counter()
    (os.killpg if group else os.kill)(proc.pid, sig)
    code = proc.wait(300)
    exited = time.perf_counter() - start
    psutil.wait_procs(tree, timeout=300)
    gone = time.perf_counter() - start
    with sqlite3.connect(db) as c:
        status = c.execute("select status from runs").fetchone()[0]
    return {"exit_s": exited, "all_gone_s": gone, "code": code, "status": status}


def _epoch_logged(db: Path) -> bool:
    try:
        with sqlite3.connect(db, timeout=5) as c:
            return bool(c.execute("select 1 from metrics where key='train_loss'").fetchone())
    except sqlite3.OperationalError:
        return False


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=1)
    a = p.parse_args(argv)
    res: dict = {}
    with tempfile.TemporaryDirectory() as d:
        for name, (sig, group) in HOW.items():
            runs = []
            for i in range(a.repeats):
                base = Path(d) / f"{len(res)}-{i}"
                base.mkdir()
                runs.append(one(base, sig, group))
            res[name] = runs
    print(table(res))
    return res


def table(res: dict) -> str:
    rows = ["| stop | flow exited, s | every process gone, s | exit code | MLflow run | goal: gone <= 15 s |",
            "|---|---|---|---|---|---|"]
    for name, runs in res.items():
        gone = summary([r["all_gone_s"] for r in runs])
        rows.append(f"| {name} | {fmt(summary([r['exit_s'] for r in runs]), 1)} | {fmt(gone, 1)} | "
                    f"{', '.join(str(r['code']) for r in runs)} | {', '.join(r['status'] for r in runs)} | "
                    f"{'yes' if gone['max'] <= GOAL_S else 'no'} |")
    rows.append("\nkill -9 leaves the MLflow run RUNNING (nothing in the flow can run); the next gpuflow run "
                "on the host marks it KILLED (tests/test_stop.py).")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
