"""`make bench`: run the CPU benchmarks and write bench/RESULTS.md (tables + commands).

    python -m bench.run_all            quick set, a few minutes on 2 cores
    python -m bench.run_all --full     adds a long job to the overhead table
    python -m bench.run_all --from-saved   rewrites RESULTS.md from the last run's figures
"""

from __future__ import annotations

import argparse
import datetime
import json

from bench import dataload, overhead, throughput, tracking
from bench.common import ROOT, machine

NOTES = (ROOT / "bench" / "NOTES.md")
GPU = (ROOT / "bench" / "RESULTS_GPU.md")
GPU_JSON = (ROOT / "bench" / "RESULTS_GPU.json")  # ratios per GPU table, for the summary


SECTIONS = [  # (title, command, module, its arguments, in --full only)
    ("1. Training-loop throughput (ours vs bare script vs Lightning)",
     "python -m bench.throughput --repeats 3", throughput, ["--repeats", "3"], False),
    ("2. Orchestration overhead (whole pipeline vs bare script)",
     "python -m bench.overhead --repeats 2", overhead, ["--repeats", "2"], False),
    ("2b. Orchestration overhead on a longer job",
     "python -m bench.overhead --repeats 1 --dataset synthetic --size 200000",
     overhead, ["--repeats", "1", "--dataset", "synthetic", "--size", "200000"], True),
    ("3. Tracking overhead (MLflow on vs off)", "python -m bench.tracking --repeats 4",
     tracking, ["--repeats", "4"], False),
    ("4. Data loading", "python -m bench.dataload --repeats 3", dataload, ["--repeats", "3"], False),
]
OUT = ROOT / "bench" / "out"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--full", action="store_true")
    p.add_argument("--from-saved", action="store_true",
                   help="rewrite RESULTS.md from the last run's bench/out/*.json (after editing NOTES.md)")
    a = p.parse_args(argv)
    sections, results = [], {}
    for title, cmd, module, args, full_only in SECTIONS:
        if full_only and not a.full:
            continue
        name = module.__name__.split(".")[-1]
        saved = OUT / f"{name}-{title.split('.')[0]}.json"
        print(f"== {title}: {cmd}", flush=True)
        if a.from_saved:
            res = json.loads(saved.read_text())
        else:
            res = module.main(args)
            OUT.mkdir(exist_ok=True)
            saved.write_text(json.dumps(res, indent=2, default=str))
        results.setdefault(name, res)
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
    w = r["overhead"]["walls"]
    po = w["server"]["median"] / w["bare"]["median"]
    rows.append(f"| pipeline / bare <= 1.3 (default job, running server) | {po:.2f} "
                f"({w['server']['median']:.1f} s vs {w['bare']['median']:.1f} s) | {'yes' if po <= 1.3 else 'no'} |")
    if w.get("floor"):
        fl = (w["bare"]["median"] + w["floor"]["median"]) / w["bare"]["median"]
        rows.append(f"| (reference) bare + an empty Prefect flow run, / bare | {fl:.2f} | "
                    "what a launch that overlaps nothing with Prefect would cost |")
    tr = r["tracking"]
    to = 100 * (tr["on"]["median"] - tr["off"]["median"]) / tr["off"]["median"]
    pp = tr["paired"]["on"]
    met = "yes" if to < 1 else ("within noise" if pp["min"] < 1 else "no")
    spread = f" (groups {pp['min']:+.1f}% to {pp['max']:+.1f}%)"
    rows.append(f"| tracking overhead < 1% of the training loop (the pipeline's way) | {to:+.1f}%{spread} | {met} |")
    gpu = json.loads(GPU_JSON.read_text()) if GPU_JSON.is_file() else {}
    for head, g in gpu.items():
        for prec in ("fp32", "bf16"):
            q, pp = g[prec], g.get("paired", {}).get(prec)
            met = "yes" if q >= 0.98 else ("within noise" if pp and pp["max"] >= 0.98 else "no")
            spread = f" ({pp['min']:.2f}-{pp['max']:.2f})" if pp else ""
            note = f"; {g['note'][prec]}" if prec in g.get("note", {}) else ""
            rows.append(f"| GPU ours / bare >= 0.98, {prec}, {head} | {q:.2f}{spread} | {met}{note} |")
    if not gpu:
        rows.append("| GPU rows (fp32 vs bf16, ours vs bare on CUDA) | `python -m bench.gpu --write` on a GPU host | "
                    "not measured |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()
