"""GPU benchmark (run where a CUDA GPU exists): gpuflow's worker vs a bare loop on CUDA,
fp32 vs bf16, peak memory.

    python -m bench.gpu --write      the issue's configuration: torchvision's resnet18, Adam,
                                     128x128 synthetic images, batch 256, fp32 and bf16,
                                     3 interleaved pairs (20000 samples, 3 epochs)

The bare side is bench/bare_gpu.py: the dataset moved to the GPU once, `torch.randperm`
batches gathered on the device, no per-step host copy, autocast for bf16. Both programs train
the same model on the same synthetic tensors with the same batch on logical GPU 0 (set
CUDA_VISIBLE_DEVICES to pick the card), one process each; each repeat runs one pair per
precision, alternating which of the two goes first. Reported: median samples/s of epochs
2..E (epoch 1 warms up) and min-max over repeats, the ratios (also per pair), and the peak
memory torch allocated in our worker. `--write` stores the table in bench/RESULTS_GPU.md,
which `make bench` (bench/run_all.py) includes in bench/RESULTS.md. Not run in CI (no GPU
there); `--device cpu` with a tiny `--size` and `--side` only checks that this script runs.
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


BARE_LOOP = "bench/bare_gpu.py: dataset on the GPU, randperm batches, autocast for bf16"


def ours(a, precision: str) -> tuple[float, float | None]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cfg = {"dataset": "synthetic", "synthetic_size": a.size, "synthetic_side": a.side, "epochs": a.epochs,
               "model": a.model, "batch_size": a.batch, "precision": precision, "device": a.device,
               "resume": "never", "checkpoint_dir": str(tmp / "ck"), "num_workers": 0,
               "checkpoint_each_epoch": not a.last_checkpoint_only}
        res, _ = run_worker(tmp, cfg)
    return loop_rate(res), res["peak_memory_mb"]


def bare(a, precision: str) -> float:
    return script_rate("bare_gpu.py", ["--device", a.device, "--model", a.model, "--precision", precision,
                                       "--synthetic-size", str(a.size), "--synthetic-side", str(a.side),
                                       "--epochs", str(a.epochs), "--batch-size", str(a.batch)])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--size", type=int, default=20000, help="synthetic samples (80%% train)")
    p.add_argument("--side", type=int, default=128, help="image side")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="pairs (ours, bare) per precision")
    p.add_argument("--last-checkpoint-only", action="store_true",
                   help="ours writes no checkpoint while training (only after the last epoch), as the bare loop")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test only")
    p.add_argument("--write", action="store_true",
                   help="write the table to bench/RESULTS_GPU.md (its ratios to RESULTS_GPU.json)")
    a = p.parse_args(argv)
    if a.write and a.device != "cuda":
        p.error("--write records GPU figures: run it with --device cuda on a GPU host")
    rates = {(tool, prec): [] for tool in ("ours", "bare") for prec in PRECISIONS}
    peak: dict[str, float] = {}
    for i in range(a.repeats):
        for prec in PRECISIONS:
            # a pair back to back, its order alternating: a drift within the pair hits both ways
            for tool in ("ours", "bare") if i % 2 == 0 else ("bare", "ours"):
                if tool == "ours":
                    r, peak[prec] = ours(a, prec)
                else:
                    r = bare(a, prec)
                rates[tool, prec].append(r)
            print(f"pair {i + 1} {prec}: ours {rates['ours', prec][-1]:.0f}, "
                  f"bare {rates['bare', prec][-1]:.0f} samples/s", flush=True)
    res = {"machine": machine(), "args": vars(a), "peak_mb": peak, "bare_loop": BARE_LOOP,
           "rates": {f"{t}/{p}": summary(v) for (t, p), v in rates.items()},
           "paired": {p: summary([o / b for o, b in zip(rates["ours", p], rates["bare", p], strict=True)])
                      for p in PRECISIONS}}
    text = table(res)
    print(json.dumps(res, indent=2))
    print(text)
    if a.write:
        flags = {k: v for k, v in vars(a).items() if k not in ("write", "device")}
        cmd = "python -m bench.gpu " + " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
                                                for k, v in flags.items() if v is not False)
        head = f"### {a.model}, {a.side}x{a.side} images, batch {a.batch}" + (
            ", ours with no checkpoint while training" if a.last_checkpoint_only else "")
        section = (f"{head}\n\nCommand: `{cmd}` on {datetime.date.today()}.\n"
                   f"Machine: {res['machine']}.\nBare loop: {BARE_LOOP}.\n\n{text}\n")
        old = OUT.read_text() if OUT.is_file() else "## 5. GPU: ours vs bare on CUDA, fp32 vs bf16\n"
        parts = [q for q in old.split("\n### ") if ("### " + q).split("\n", 1)[0] != head]  # replace a rerun
        OUT.write_text("\n### ".join(parts).rstrip("\n") + "\n\n" + section)
        ratios = json.loads(OUT_JSON.read_text()) if OUT_JSON.is_file() else {}
        r = res["rates"]
        ratios[head.removeprefix("### ")] = {
            **{p: r[f"ours/{p}"]["median"] / r[f"bare/{p}"]["median"] for p in PRECISIONS},
            "paired": res["paired"], "bare_loop": BARE_LOOP}
        OUT_JSON.write_text(json.dumps(ratios, indent=2))
        print(f"wrote {OUT}")
    return res


def table(res: dict) -> str:
    r, peak, a = res["rates"], res["peak_mb"], res["args"]
    mib = {p: f"{peak[p]:.0f}" if peak.get(p) is not None else "n/a (CPU)" for p in PRECISIONS}
    rows = [("| precision | gpuflow samples/s | bare samples/s | ours/bare, medians (goal >= 0.98) | "
             "ours/bare per pair, median (min-max) | peak MiB (ours) |"), "|---|---|---|---|---|---|"]
    for prec in PRECISIONS:
        o, b = r[f"ours/{prec}"], r[f"bare/{prec}"]
        pp = res.get("paired", {}).get(prec)
        pair = f"{pp['median']:.2f} ({pp['min']:.2f}-{pp['max']:.2f})" if pp else ""
        rows.append(f"| {prec} | {fmt(o)} | {fmt(b)} | {o['median'] / b['median']:.2f} | {pair} | {mib[prec]} |")
    speed = r["ours/bf16"]["median"] / r["ours/fp32"]["median"]
    mem = (f"; peak memory bf16 / fp32 = {peak['bf16'] / peak['fp32']:.2f}"
           if peak.get("bf16") is not None and peak.get("fp32") else "")
    rows.append(f"\nbf16 / fp32 (ours) = {speed:.2f}{mem}. Model {a['model']}, batch {a['batch']}, "
                f"{a['size']} synthetic {a['side']}x{a['side']} samples, {a['epochs']} epochs, "
                f"{a['repeats']} pairs per precision.")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
