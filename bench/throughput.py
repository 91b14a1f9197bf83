"""Training-loop throughput: gpuflow's worker vs the bare seeds-style script vs Lightning.

Same model (SimpleNN), data (synthetic, in memory), global batch, fp32, world size; the three
run interleaved in every repeat so machine noise hits all alike. Per run: median samples/s
of epochs 2..E (epoch 1 warms up). Reported: median over repeats and min-max.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.common import fmt, loop_args, loop_rate, run_worker, script_rate, summary


def ours(world: int, a, tmp: Path) -> float:
    cfg = {"dataset": "synthetic", "synthetic_size": a.size, "epochs": a.epochs, "batch_size": a.batch,
           "model": "mlp", "resume": "never", "checkpoint_dir": str(tmp / "ck"),
           "strategy": "ddp" if world > 1 else "single", "device": "cpu"}
    return loop_rate(run_worker(tmp, cfg, world)[0])


def script(name: str, world: int, a) -> float:
    return script_rate(name, ["--synthetic-size", str(a.size), "--epochs", str(a.epochs),
                              "--batch-size", str(a.batch)], world)


def have_lightning() -> bool:
    try:
        import lightning  # noqa: F401
        return True
    except ImportError:
        return False


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    loop_args(p)
    a = p.parse_args(argv)
    tools = ["ours", "bare"] + (["lightning"] if have_lightning() else [])
    results: dict = {}
    for world in map(int, a.worlds.split(",")):
        rates: dict[str, list[float]] = {t: [] for t in tools}
        for _ in range(a.repeats):
            with tempfile.TemporaryDirectory() as d:
                rates["ours"].append(ours(world, a, Path(d)))
            rates["bare"].append(script("bare_ddp.py", world, a))
            if "lightning" in tools:
                rates["lightning"].append(script("lightning_ref.py", world, a))
        results[world] = {t: summary(v) for t, v in rates.items()}
        # ratios within each repeat (the programs ran back to back): drifts of the shared
        # machine between repeats cancel, which the ratio of medians does not do
        results[world]["paired"] = {t: summary([o / x for o, x in zip(rates["ours"], rates[t], strict=True)])
                                    for t in tools if t != "ours"}
        r = results[world]
        print(f"world {world}: " + ", ".join(f"{t} {fmt(r[t])}" for t in tools), flush=True)
    return {"args": vars(a), "results": results}


def table(res: dict) -> str:
    rows = ["| world | gpuflow samples/s | bare samples/s | ours/bare (goal >= 0.98) | Lightning samples/s | ours/Lightning (goal >= 1.0) |",
            "|---|---|---|---|---|---|"]
    for world, r in res["results"].items():
        pr = r["paired"]
        ob = f"{pr['bare']['median']:.2f} ({pr['bare']['min']:.2f}-{pr['bare']['max']:.2f})"
        lt = r.get("lightning")
        ol = (f"{pr['lightning']['median']:.2f} ({pr['lightning']['min']:.2f}-{pr['lightning']['max']:.2f})"
              if lt else "n/a (lightning not installed)")
        rows.append(f"| {world} | {fmt(r['ours'])} | {fmt(r['bare'])} | {ob} | "
                    f"{fmt(lt) if lt else 'n/a'} | {ol} |")
    rows.append("\nRatios: median (min-max) of ours / other within each repeat.")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(main()))
