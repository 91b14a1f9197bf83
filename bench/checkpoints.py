"""Checkpoints that cost nothing: gpuflow's worker, writing a checkpoint every epoch, against the
bare loop (bench/bare_ddp.py, no checkpoints), on the digits job where epochs are tens of ms.

Per-epoch wall of the whole loop (training, the held-out evaluation, and for gpuflow the checkpoint
and its retention): the worker's `train_time_s` / epochs, the bare loop's `loop_s` / epochs. The two
run interleaved in every repeat. Also the disk the run's checkpoints take at its end (the policy:
the last `keep_checkpoints` and the best) against what one file per epoch kept would take.

Goal (issue 37): worker / bare >= 0.98 (per-epoch throughput, checkpoints on).

    python -m bench.checkpoints [--repeats 3] [--epochs 60] [--worlds 1,2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench.common import ROOT, fmt, interleaved, json_lines, launcher, machine, run, run_worker, summary


def ours(world: int, epochs: int, tmp: Path, disk: list) -> float:
    """ms per epoch of gpuflow's worker; appends (bytes kept, bytes of one file per epoch)."""
    ck = tmp / "ck"
    cfg = {"dataset": "digits", "model": "mlp", "epochs": epochs, "batch_size": 64, "resume": "never",
           "checkpoint_dir": str(ck), "strategy": "ddp" if world > 1 else "single", "device": "cpu",
           "data_root": str(tmp / "data")}
    result, _ = run_worker(tmp, cfg, world)
    files = list(ck.glob("epoch-*.pt"))
    disk.append((sum(f.stat().st_size for f in files), statistics.mean(f.stat().st_size for f in files) * epochs))
    for f in files:
        f.unlink()
    return 1000 * result["train_time_s"] / epochs


def bare(world: int, epochs: int) -> float:
    _, out = run([*launcher(world), str(ROOT / "bench" / "bare_ddp.py"), "--dataset", "digits",
                  "--epochs", str(epochs), "--batch-size", "64", "--val-each-epoch"])
    (loop,) = [r["loop_s"] for r in json_lines(out) if "loop_s" in r]
    return 1000 * loop / epochs


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--worlds", default="1,2")
    a = p.parse_args(argv)
    print(machine(), flush=True)
    out = {}
    for world in map(int, a.worlds.split(",")):
        disk: list = []
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            ms = interleaved(a.repeats, {"gpuflow": lambda: ours(world, a.epochs, tmp, disk),
                                         "bare": lambda: bare(world, a.epochs)})
        ratio = summary([b / o for o, b in zip(ms["gpuflow"], ms["bare"])])
        kept, all_epochs = disk[-1]
        out[world] = {"ms": {k: summary(v) for k, v in ms.items()}, "ratio": ratio, "kept_mb": kept / 2**20,
                      "every_epoch_mb": all_epochs / 2**20}
        print(f"world {world}: gpuflow {fmt(out[world]['ms']['gpuflow'], 1)} ms/epoch, bare "
              f"{fmt(out[world]['ms']['bare'], 1)} ms/epoch; gpuflow / bare throughput {fmt(ratio, 2)} "
              f"(goal >= 0.98); checkpoints kept {kept / 2**20:.1f} MB vs {all_epochs / 2**20:.1f} MB for "
              f"one per epoch", flush=True)
    return out


if __name__ == "__main__":
    main()
