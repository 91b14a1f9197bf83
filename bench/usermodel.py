"""A user's model in gpuflow's loop vs the same model in a bare seed-style torchrun script.

The model and the dataset are not gpuflow's: bench/userproj/benchnet (a plain nn.Module and
a map-style Dataset read one sample at a time), named by reference as a user names theirs
(`--model benchnet.nets:Net --dataset benchnet.data:datasets`). The bare script
(bench/bare_user.py) imports the same two and runs the seeds' loop. Same data file, global
batch, fp32, world size; the two run back to back in every repeat. Per run: median samples/s
of epochs 2..E. Goal (issue 16): ours / bare >= 0.98 at world 1 and 2.
"""

from __future__ import annotations

import argparse
from functools import partial
import sys
import tempfile
from pathlib import Path

from bench.common import ROOT, fmt, interleaved, loop_args, loop_rate, run_worker, script_rate, summary

PROJECT = ROOT / "bench" / "userproj"
GOAL = 0.98


def ours(world: int, a, data: Path) -> float:
    with tempfile.TemporaryDirectory() as t:
        return _ours(world, a, Path(t), data)


def _ours(world: int, a, tmp: Path, data: Path) -> float:
    cfg = {"model": "benchnet.nets:Net", "model_args": {"hidden": a.hidden},
           "dataset": "benchnet.data:datasets", "data_root": str(data), "code_root": str(PROJECT),
           "epochs": a.epochs, "batch_size": a.batch, "resume": "never", "checkpoint_dir": str(tmp / "ck"),
           "strategy": "ddp" if world > 1 else "single", "device": "cpu"}
    return loop_rate(run_worker(tmp, cfg, world)[0])


def bare(world: int, a, data: Path) -> float:
    return script_rate("bare_user.py", ["--data-root", str(data), "--epochs", str(a.epochs),
                                        "--batch-size", str(a.batch), "--hidden", str(a.hidden)], world)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    loop_args(p)
    p.add_argument("--hidden", type=int, default=256)
    a = p.parse_args(argv)
    sys.path.insert(0, str(PROJECT))
    from benchnet.data import write

    results: dict = {}
    with tempfile.TemporaryDirectory() as d:
        data = Path(d) / "data"
        write(str(data), a.size)
        for world in map(int, a.worlds.split(",")):
            rates = interleaved(a.repeats, {"ours": partial(ours, world, a, data),
                                            "bare": partial(bare, world, a, data)})
            r = results[world] = {t: summary(v) for t, v in rates.items()}
            r["paired"] = summary([o / b for o, b in zip(rates["ours"], rates["bare"], strict=True)])
            print(f"world {world}: ours {fmt(r['ours'])}, bare {fmt(r['bare'])}, "
                  f"ours/bare {r['paired']['median']:.3f}", flush=True)
    return {"args": vars(a), "results": results}


def goals(res: dict) -> list[tuple[str, str, str]]:
    out = []
    for world, r in res["results"].items():
        q = r["paired"]
        met = "yes" if q["median"] >= GOAL else ("within noise" if q["max"] >= GOAL else "no")
        out.append((f"user model: ours / bare >= {GOAL}, world {world}",
                    f"{q['median']:.2f} ({q['min']:.2f}-{q['max']:.2f})", met))
    return out


def table(res: dict) -> str:
    a = res["args"]
    rows = [f"Model: bench/userproj `benchnet.nets:Net` (784-{a['hidden']}-10 MLP, not a built-in) on its own "
            f"map-style dataset ({a['size']} samples, 80% train), batch {a['batch']}, {a['epochs']} epochs, "
            f"fp32, CPU; {a['repeats']} repeats.", "",
            "| world | gpuflow samples/s | bare script samples/s | ours/bare (goal >= 0.98) |", "|---|---|---|---|"]
    for world, r in res["results"].items():
        q = r["paired"]
        rows.append(f"| {world} | {fmt(r['ours'])} | {fmt(r['bare'])} | "
                    f"{q['median']:.2f} ({q['min']:.2f}-{q['max']:.2f}) |")
    rows.append("\nRatios: median (min-max) of ours / bare within each repeat.")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(main()))
