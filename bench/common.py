"""Helpers shared by the benchmarks: run commands, time them, summarise repeats."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone"]


def env(**extra) -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("MLFLOW_RUN_ID", "GPUFLOW_FAULT", "GPUFLOW_METRICS_FILE"):  # no faults, no live metrics
        e.pop(k, None)
    e.update({k: str(v) for k, v in extra.items()})
    return e


def run(cmd: list[str], cwd: Path = ROOT, timeout: float = 600, **extra_env) -> tuple[float, str]:
    """Run cmd; return (wall seconds, stdout). Raises with the output tail on failure."""
    start = time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, env=env(**extra_env), capture_output=True, text=True,
                       timeout=timeout)
    wall = time.perf_counter() - start
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return wall, p.stdout


def json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def fmt(s: dict, digits: int = 0) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def machine() -> str:
    import torch

    return (f"{platform.node()} · {os.cpu_count()} CPUs · {platform.python_version()} · "
            f"torch {torch.__version__} · CUDA available: {torch.cuda.is_available()}")


def launcher(world: int) -> list[str]:
    """torchrun for several processes, plain python for one (as the pipeline launches)."""
    return [*TORCHRUN, f"--nproc_per_node={world}"] if world > 1 else [PY]


def run_worker(tmp: Path, cfg: dict, world: int = 1, **extra_env) -> tuple[dict, float]:
    """Run gpuflow's worker on `cfg` (written to tmp/cfg.json); return (result.json, wall s)."""
    (tmp / "cfg.json").write_text(json.dumps(cfg))
    wall, _ = run([*launcher(world), "-m", "gpuflow.training", "--config", str(tmp / "cfg.json")], **extra_env)
    return json.loads((tmp / "result.json").read_text()), wall


def loop_rate(result: dict) -> float:
    """Median samples/s of epochs 2..E of a worker result (epoch 1 warms up)."""
    return statistics.median(h["samples_per_s"] for h in result["history"][1:])


def script_rate(script: str, args: list[str], world: int = 1) -> float:
    """Run a reference script under bench/ and take the median samples/s of its epochs 2..E."""
    _, out = run([*launcher(world), str(ROOT / "bench" / script), *args])
    rates = [r["samples_per_s"] for r in json_lines(out) if "samples_per_s" in r]
    return statistics.median(rates[1:])


def loop_args(p) -> None:
    """The training-loop benchmarks' shared options (bench.throughput, bench.usermodel)."""
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--size", type=int, default=16384)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--worlds", default="1,2")


def interleaved(repeats: int, runs: dict) -> dict[str, list[float]]:
    """{name: [value per repeat]}: each repeat calls every `runs[name]()` back to back, the
    order alternating between repeats so that a drift within a repeat favours none. Prints
    each repeat's values."""
    values: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for i in range(repeats):
        for name in names if i % 2 == 0 else names[::-1]:
            values[name].append(runs[name]())
        print({k: round(v[-1], 1) for k, v in values.items()}, flush=True)
    return values
