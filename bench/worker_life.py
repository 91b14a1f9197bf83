"""A worker's life outside its epochs: `python -m gpuflow.training` on `digits`, one process, as a sweep's
CPU trial runs it. Per run: process start to the first epoch's line (imports, data, model, the optimizer's
torch._dynamo import, epoch 1), the last epoch's line to result.json (weights, input example, result), and
result.json to the process's exit (barrier, teardown, `os._exit`). A sweep's slot waits
on all three for every trial.

    python -m bench.worker_life --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT


def one(tmp: Path, epochs: int) -> dict[str, float]:
    cfg = {"dataset": "digits", "model": "mlp", "epochs": epochs, "resume": "never",
           "checkpoint_dir": str(tmp / "ck"), "checkpoint_each_epoch": False}
    (tmp / "cfg.json").write_text(json.dumps(cfg))
    start = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "gpuflow.training", "--config", str(tmp / "cfg.json")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seen = [time.time() for line in proc.stdout if " epoch " in line]
    proc.wait()
    end = time.time()
    assert proc.returncode == 0 and len(seen) == epochs, (proc.returncode, len(seen))
    written = (tmp / "result.json").stat().st_mtime
    return {"to first epoch": seen[0] - start, "last epoch to result": written - seen[-1],
            "result to exit": end - written}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--epochs", type=int, default=3)
    a = p.parse_args(argv)
    runs = []
    for _ in range(a.repeats):
        with tempfile.TemporaryDirectory() as d:
            runs.append(one(Path(d), a.epochs))
    out = {k: {"median": statistics.median(r[k] for r in runs), "min": min(r[k] for r in runs),
               "max": max(r[k] for r in runs)} for k in runs[0]}
    for k, v in out.items():
        print(f"{k:22s} {v['median']:.3f} s ({v['min']:.3f}-{v['max']:.3f})")
    return out


if __name__ == "__main__":
    main()
