"""`make bench`: run the CPU benchmarks and write bench/RESULTS.md (tables + commands).

    python -m bench.run_all            the quick set (sections 1, 1b, 2, 2c, 3, 4 and 6)
    python -m bench.run_all --full     adds 2b, the long job for the pipeline / bare ratio goal
    python -m bench.run_all --from-saved   rewrites RESULTS.md from the last run's figures
"""

from __future__ import annotations

import argparse
import datetime
import json

from bench import dataload, overhead, script, stop, throughput, tracking, usermodel
from bench.common import ROOT, machine

NOTES = (ROOT / "bench" / "NOTES.md")
GPU = (ROOT / "bench" / "RESULTS_GPU.md")
GPU_JSON = (ROOT / "bench" / "RESULTS_GPU.json")  # ratios per GPU table, for the summary


# The long job (2b): mlp on synthetic data sized so that the bare script takes over a minute on
# a 2-core host (bench/NOTES.md has the measurement); server mode only, 1-epoch warm-up run.
LONG_JOB = ["--repeats", "2", "--dataset", "synthetic", "--size", "250000", "--modes", "server",
            "--first-epochs", "1"]

SECTIONS = [  # (key, title, module, its arguments, in --full only)
    ("throughput", "1. Training-loop throughput (ours vs bare script vs Lightning)",
     throughput, ["--repeats", "3"], False),
    ("usermodel", "1b. A user's own model and dataset (ours vs a bare script on the same model)",
     usermodel, ["--repeats", "3"], False),
    ("overhead", "2. Orchestration overhead, default job (whole pipeline vs bare script)",
     overhead, ["--repeats", "3"], False),
    ("overhead_long", "2b. Orchestration overhead on a long job (bare run >= 1 minute)",
     overhead, LONG_JOB, True),
    ("script", "2c. Your own torchrun script under the pipeline vs bare torchrun (bare run >= 30 s)",
     script, ["--repeats", "3"], False),
    ("tracking", "3. Tracking overhead (MLflow on vs off)", tracking, ["--repeats", "4"], False),
    ("dataload", "4. Data loading", dataload, ["--repeats", "3"], False),
    ("stop", "6. Stopping a running pipeline (Ctrl-C, SIGTERM, kill -9)", stop, ["--repeats", "1"], False),
]
OUT = ROOT / "bench" / "out"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--full", action="store_true")
    p.add_argument("--from-saved", action="store_true",
                   help="rewrite RESULTS.md from the last run's bench/out/*.json (after editing NOTES.md)")
    a = p.parse_args(argv)
    sections, results = [], {}
    for key, title, module, args, full_only in SECTIONS:
        if full_only and not a.full:
            continue
        cmd = f"python -m {module.__name__} {' '.join(args)}"
        saved = OUT / f"{key}.json"
        print(f"== {title}: {cmd}", flush=True)
        if a.from_saved:
            res = json.loads(saved.read_text())
        else:
            res = module.main(args)
            OUT.mkdir(exist_ok=True)
            saved.write_text(json.dumps(res, indent=2, default=str))
        results[key] = res
        text = module.table(res)
        print(text, flush=True)
        sections.append(f"## {title}\n\nCommand: `{cmd}`\n\n{text}\n")
    head = (f"# Benchmark results\n\nWritten by `python -m bench.run_all{' --full' if a.full else ''}` "
            f"(`make bench`) on {datetime.date.today()}.\nMachine: {machine()}.\n"
            "Figures: median over repeats, (min-max) in brackets. Ratios use medians.\n")
    notes = NOTES.read_text() if NOTES.is_file() else ""
    # written by `python -m bench.gpu --write` on a GPU machine; kept across CPU regenerations
    gpu = GPU.read_text() if GPU.is_file() else "## 5. GPU\n\nNot measured yet: run `python -m bench.gpu --write` on a GPU machine.\n"
    (ROOT / "bench" / "RESULTS.md").write_text("\n".join([head, goals(results), *sections, gpu, notes]))
    print("wrote bench/RESULTS.md")


def goals(r: dict) -> str:
    """The issue's goals, each with the measured figure (medians) and whether it is met."""
    rows = ["## Summary against the goals", "", "| goal | measured | met? |", "|---|---|---|"]
    for world, t in r["throughput"]["results"].items():
        for other, goal in (("bare", 0.98), ("lightning", 1.0)):
            if other in t["paired"]:
                q = t["paired"][other]
                met = "yes" if q["median"] >= goal else ("within noise" if q["max"] >= goal else "no")
                rows.append(f"| ours / {other} >= {goal}, world {world} | {q['median']:.2f} "
                            f"({q['min']:.2f}-{q['max']:.2f}) | {met} |")
    if "usermodel" in r:
        for goal, measured, met in usermodel.goals(r["usermodel"]):
            rows.append(f"| {goal} | {measured} | {met} |")
    for goal, measured, met in overhead.goals(r["overhead"]):
        rows.append(f"| {goal} | {measured} | {met} |")
    if "overhead_long" in r:
        for goal, measured, met in overhead.goals(r["overhead_long"]):
            rows.append(f"| {goal} | {measured} | {met} |")
    else:
        rows.append(f"| pipeline / bare <= {overhead.RATIO_GOAL} (bare run >= {overhead.LONG_BARE_S:.0f} s, "
                    "running server) | `make bench ARGS=--full` (section 2b); the last measurement is in bench/NOTES.md, "
                    "'2b rerun after the synthetic-data fix' | not measured in this run |")
    w = r["overhead"]["walls"]
    if w.get("floor"):
        fl = (w["bare"]["median"] + w["floor"]["median"]) / w["bare"]["median"]
        rows.append(f"| (reference) bare + an empty Prefect flow run, / bare | {fl:.2f} | "
                    "what a launch that overlaps nothing with Prefect would cost |")
    if "script" in r:
        for goal, measured, met in script.goals(r["script"]):
            rows.append(f"| {goal} | {measured} | {met} |")
    tr = r["tracking"]
    to = 100 * (tr["on"]["median"] - tr["off"]["median"]) / tr["off"]["median"]
    pp = tr["paired"]["on"]
    met = "yes" if to < 1 else ("within noise" if pp["min"] < 1 else "no")
    spread = f" (groups {pp['min']:+.1f}% to {pp['max']:+.1f}%)"
    rows.append(f"| tracking overhead < 1% of the training loop (the pipeline's way) | {to:+.1f}%{spread} | {met} |")
    if "stop" in r:
        for name, runs in r["stop"].items():
            worst = max(x["all_gone_s"] for x in runs)
            rows.append(f"| {name}: every process of the run gone <= {stop.GOAL_S:.0f} s | {worst:.1f} s | "
                        f"{'yes' if worst <= stop.GOAL_S else 'no'} |")
    gpu = json.loads(GPU_JSON.read_text()) if GPU_JSON.is_file() else {}
    for head, g in gpu.items():
        for prec in ("fp32", "bf16"):
            q, pp = g[prec], g.get("paired", {}).get(prec)
            met = "yes" if q >= 0.98 else ("within noise" if pp and pp["max"] >= 0.98 else "no")
            if "bare_loop" not in g:  # written before bench/bare_gpu.py: not the goal's comparison
                met = ("not judged: against the old bare loop that copied every batch from the host; "
                       "rerun `python -m bench.gpu --write`")
            spread = f" ({pp['min']:.2f}-{pp['max']:.2f})" if pp else ""
            note = f"; {g['note'][prec]}" if prec in g.get("note", {}) else ""
            rows.append(f"| GPU ours / bare >= 0.98, {prec}, {head} | {q:.2f}{spread} | {met}{note} |")
    if not gpu:
        rows.append("| GPU rows (fp32 vs bf16, ours vs bare on CUDA) | `python -m bench.gpu --write` on a GPU host | "
                    "not measured |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()
