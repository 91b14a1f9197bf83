"""The sweep flow's own CPU per epoch line (issue #37: Optuna's report/should_prune and the metrics
relay were ~44 ms a line on f9a2b00, a quarter of the flow's samples).

`gpuflow sweep` (mlp on digits, 4 trials of 2 at a time, --pruner median and none) is run with
`--epochs` short and long; the flow process's own CPU (getrusage(RUSAGE_SELF): all its threads,
none of its children) is read at its exit. The per-line cost is the difference over the epoch lines
it relayed; the flow's share of one core while trials train is that cost over the training wall.

    python -m bench.flow_cpu [--short 5] [--long 100]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path

from bench.common import PY, ROOT, env
from bench.sweep import SPACE
from tests.servers import prefect_server

SELF_CPU = """import atexit, resource, sys, time
t0 = time.time()
def said():
    r = resource.getrusage(resource.RUSAGE_SELF)
    print(f"FLOWCPU {r.ru_utime + r.ru_stime:.2f} {time.time() - t0:.2f}", file=sys.__stderr__, flush=True)
atexit.register(said)
sys.argv = ["gpuflow", *sys.argv[1:]]
from gpuflow.flows.__main__ import entry
sys.exit(entry())
"""


def one(tmp: Path, api: str, epochs: int, pruner: str, n: int) -> tuple[float, float, int]:
    """(flow CPU s, wall s, epoch lines relayed)."""
    folder = tmp / f"{pruner}-{epochs}-{n}"
    folder.mkdir()
    (folder / "space.yaml").write_text(SPACE)
    cmd = [PY, str(tmp / "self_cpu.py"), "sweep", "--space", "space.yaml", "--trials", "4", "--parallel", "2",
           "--gpus", "cpu", "--model", "mlp", "--dataset", "digits", "--epochs", str(epochs), "--study", "s",
           "--sampler-seed", "1", "--pruner", pruner, "--tracking-uri", f"sqlite:///{folder / 'mlflow.db'}",
           "--runs-dir", str(folder / "runs"), "--data-root", str(tmp / "data")]
    p = subprocess.run(cmd, cwd=folder, env=env(PREFECT_API_URL=api, PYTHONPATH=str(ROOT)), capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    cpu, wall = map(float, re.search(r"FLOWCPU (\S+) (\S+)", p.stderr).groups())
    return cpu, wall, len(re.findall(rf"epoch \d+/{epochs} ", p.stderr))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--short", type=int, default=5)
    ap.add_argument("--long", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "self_cpu.py").write_text(SELF_CPU)
        (tmp / "prefect-home").mkdir()
        server, api = prefect_server(tmp / "prefect-home", env())
        with server:
            server.wait()
            one(tmp, api, a.short, "none", -1)  # the digits prepared once, imports warm
            print(f"{os.cpu_count()} CPUs; 4 trials, 2 at a time; flow CPU s / wall s / epoch lines")
            for pruner in ("median", "none"):
                for n in range(a.repeats):
                    short, long_ = one(tmp, api, a.short, pruner, n), one(tmp, api, a.long, pruner, n)
                    per_line = (long_[0] - short[0]) / max(1, long_[2] - short[2])
                    share = (long_[0] - short[0]) / max(0.1, long_[1] - short[1])
                    print(f"--pruner {pruner}: {a.short} epochs {short[0]:.1f} / {short[1]:.1f} / {short[2]}; "
                          f"{a.long} epochs {long_[0]:.1f} / {long_[1]:.1f} / {long_[2]}; "
                          f"per epoch line {per_line * 1000:.1f} ms of flow CPU; "
                          f"the flow's share of one core over the longer training {share:.0%}", flush=True)


if __name__ == "__main__":
    main()
