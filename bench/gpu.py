"""GPU benchmarks (run where a CUDA GPU exists): fp32 vs bf16 on one GPU, peak memory.

    python -m bench.gpu --model resnet18 --size 50000 --epochs 3

Runs gpuflow's worker on logical GPU 0 (set CUDA_VISIBLE_DEVICES to pick the card) for each
precision, interleaved over repeats, and reports median samples/s of epochs 2..E and the
peak memory torch allocated. Not run in CI (no GPU there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench.common import PY, fmt, machine, run, summary


def one(tmp: Path, a, precision: str) -> tuple[float, float]:
    cfg = {"dataset": "synthetic", "synthetic_size": a.size, "epochs": a.epochs, "model": a.model,
           "batch_size": a.batch, "precision": precision, "device": "cuda", "resume": "never",
           "checkpoint_dir": str(tmp / "ck"), "num_workers": 0}
    (tmp / "cfg.json").write_text(json.dumps(cfg))
    run([PY, "-m", "training", "--config", str(tmp / "cfg.json")])
    res = json.loads((tmp / "result.json").read_text())
    return statistics.median(h["samples_per_s"] for h in res["history"][1:]), res["peak_memory_mb"]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--size", type=int, default=50000)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    rates = {"fp32": [], "bf16": []}
    peak = {}
    for _ in range(a.repeats):
        for prec in rates:
            with tempfile.TemporaryDirectory() as d:
                r, m = one(Path(d), a, prec)
                rates[prec].append(r)
                peak[prec] = m
    res = {"machine": machine(), "args": vars(a), "rates": {k: summary(v) for k, v in rates.items()},
           "peak_mb": peak}
    print(json.dumps(res, indent=2))
    print("| precision | samples/s | peak MiB |\n|---|---|---|\n" + "\n".join(
        f"| {k} | {fmt(res['rates'][k])} | {peak[k]:.0f} |" for k in rates))
    print(f"bf16 / fp32 = {res['rates']['bf16']['median'] / res['rates']['fp32']['median']:.2f}")
    return res


if __name__ == "__main__":
    main()
