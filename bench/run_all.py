"""`make bench`: run the CPU benchmarks and write bench/RESULTS.md (tables + commands).

    python -m bench.run_all            quick set, a few minutes on 2 cores
    python -m bench.run_all --full     adds a long job to the overhead table
"""

from __future__ import annotations

import argparse
import datetime
import json

from bench import dataload, overhead, throughput, tracking
from bench.common import ROOT, machine

NOTES = (ROOT / "bench" / "NOTES.md")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--full", action="store_true")
    a = p.parse_args(argv)
    sections = []

    def section(title, cmd, module, args):
        print(f"== {title}: {cmd}", flush=True)
        res = module.main(args)
        (ROOT / "bench" / "out").mkdir(exist_ok=True)
        (ROOT / "bench" / "out" / f"{module.__name__.split('.')[-1]}-{len(sections)}.json").write_text(
            json.dumps(res, indent=2, default=str))
        text = module.table(res)
        print(text, flush=True)
        sections.append(f"## {title}\n\nCommand: `{cmd}`\n\n{text}\n")

    section("1. Training-loop throughput (ours vs bare script vs Lightning)",
            "python -m bench.throughput --repeats 3", throughput, ["--repeats", "3"])
    section("2. Orchestration overhead (whole pipeline vs bare script)",
            "python -m bench.overhead --repeats 2", overhead, ["--repeats", "2"])
    if a.full:
        section("2b. Orchestration overhead on a longer job",
                "python -m bench.overhead --repeats 1 --dataset synthetic --size 200000",
                overhead, ["--repeats", "1", "--dataset", "synthetic", "--size", "200000"])
    section("3. Tracking overhead (MLflow on vs off)", "python -m bench.tracking --repeats 3",
            tracking, ["--repeats", "3"])
    section("4. Data loading", "python -m bench.dataload --repeats 3", dataload, ["--repeats", "3"])
    head = (f"# Benchmark results\n\nWritten by `python -m bench.run_all{' --full' if a.full else ''}` "
            f"(`make bench`) on {datetime.date.today()}.\nMachine: {machine()}.\n"
            "Figures: median over repeats, (min-max) in brackets. Ratios use medians.\n")
    notes = NOTES.read_text() if NOTES.is_file() else ""
    (ROOT / "bench" / "RESULTS.md").write_text("\n".join([head, *sections, notes]))
    print("wrote bench/RESULTS.md")


if __name__ == "__main__":
    main()
