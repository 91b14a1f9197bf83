"""GPU benchmarks (run where a CUDA GPU exists): gpuflow's worker vs the bare script on CUDA,
fp32 vs bf16, peak memory.

    python -m bench.gpu --model resnet18 --size 50000 --epochs 3 --write

Both programs train the same model on the same in-memory synthetic data with the same global
batch on logical GPU 0 (set CUDA_VISIBLE_DEVICES to pick the card), one process each,
interleaved over repeats so drifts in clocks hit all alike. Reported: median samples/s of
epochs 2..E (epoch 1 warms up) and min-max over repeats, the ratios, and the peak memory
torch allocated in our worker. `--write` stores the table in bench/RESULTS_GPU.md, which
`make bench` (bench/run_all.py) includes in bench/RESULTS.md. Not run in CI (no GPU there).
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
from pathlib import Path

from bench.common import ROOT, fmt, loop_rate, machine, run_worker, script_rate, summary

PRECISIONS = ("fp32", "bf16")
OUT = ROOT / "bench" / "RESULTS_GPU.md"
OUT_JSON = ROOT / "bench" / "RESULTS_GPU.json"


def ours(tmp: Path, a, precision: str) -> tuple[float, float]:
    cfg = {"dataset": "synthetic", "synthetic_size": a.size, "synthetic_side": a.side, "epochs": a.epochs,
           "model": a.model, "batch_size": a.batch, "precision": precision, "device": "cuda", "resume": "never",
           "checkpoint_dir": str(tmp / "ck"), "num_workers": 0}
    res, _ = run_worker(tmp, cfg)
    return loop_rate(res), res["peak_memory_mb"]


def bare(a, precision: str) -> float:
    return script_rate("bare_ddp.py", ["--device", "cuda", "--model", a.model, "--precision", precision,
                                       "--synthetic-size", str(a.size), "--synthetic-side", str(a.side),
                                       "--epochs", str(a.epochs), "--batch-size", str(a.batch)])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--size", type=int, default=50000, help="synthetic samples (80%% train)")
    p.add_argument("--side", type=int, default=28, help="image side (28: launch-bound on a big GPU)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--write", action="store_true", help=f"write the table to {OUT.relative_to(ROOT)}")
    a = p.parse_args(argv)
    rates = {(tool, prec): [] for tool in ("ours", "bare") for prec in PRECISIONS}
    peak: dict[str, float] = {}
    for i in range(a.repeats):
        for prec in PRECISIONS:
            with tempfile.TemporaryDirectory() as d:
                r, m = ours(Path(d), a, prec)
            rates["ours", prec].append(r)
            peak[prec] = m
            rates["bare", prec].append(bare(a, prec))
            print(f"repeat {i + 1} {prec}: ours {r:.0f}, bare {rates['bare', prec][-1]:.0f} samples/s", flush=True)
    res = {"machine": machine(), "args": vars(a), "peak_mb": peak,
           "rates": {f"{t}/{p}": summary(v) for (t, p), v in rates.items()}}
    text = table(res)
    print(json.dumps(res, indent=2))
    print(text)
    if a.write:
        cmd = "python -m bench.gpu " + " ".join(f"--{k} {v}" for k, v in vars(a).items() if k != "write")
        head = f"### {a.model}, {a.side}x{a.side} images, batch {a.batch}"
        section = (f"{head}\n\nCommand: `{cmd}` on {datetime.date.today()}.\n"
                   f"Machine: {res['machine']}.\n\n{text}\n")
        old = OUT.read_text() if OUT.is_file() else "## 5. GPU: ours vs bare on CUDA, fp32 vs bf16\n"
        parts = [q for q in old.split("\n### ") if not ("### " + q).startswith(head)]  # replace a rerun
        OUT.write_text("\n### ".join(parts).rstrip("\n") + "\n\n" + section)
        ratios = json.loads(OUT_JSON.read_text()) if OUT_JSON.is_file() else {}
        r = res["rates"]
        ratios[head.removeprefix("### ")] = {
            **{p: r[f"ours/{p}"]["median"] / r[f"bare/{p}"]["median"] for p in PRECISIONS},
            "paired": {p: summary([o / b for o, b in zip(rates["ours", p], rates["bare", p], strict=True)])
                       for p in PRECISIONS}}
        OUT_JSON.write_text(json.dumps(ratios, indent=2))
        print(f"wrote {OUT}")
    return res


def table(res: dict) -> str:
    r = res["rates"]
    rows = ["| precision | gpuflow samples/s | bare samples/s | ours/bare (goal >= 0.98) | peak MiB (ours) |",
            "|---|---|---|---|---|"]
    for prec in PRECISIONS:
        o, b = r[f"ours/{prec}"], r[f"bare/{prec}"]
        rows.append(f"| {prec} | {fmt(o)} | {fmt(b)} | {o['median'] / b['median']:.2f} | "
                    f"{res['peak_mb'][prec]:.0f} |")
    speed = r["ours/bf16"]["median"] / r["ours/fp32"]["median"]
    rows.append(f"\nbf16 / fp32 (ours) = {speed:.2f}; peak memory bf16 / fp32 = "
                f"{res['peak_mb']['bf16'] / res['peak_mb']['fp32']:.2f}. "
                f"Model {res['args']['model']}, batch {res['args']['batch']}, "
                f"{res['args']['size']} synthetic {res['args']['side']}x{res['args']['side']} samples, "
                f"{res['args']['epochs']} epochs.")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
