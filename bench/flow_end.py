"""A flow run's end on gpuflow's temporary Prefect API: heartbeats as Prefect sends them by default against
none (what flows/api.py prefect_api() sets for a temporary server, which runs no services to read them).

Prefect 3.8's heartbeat thread sleeps in 1-s steps and a flow run's end joins it, so a run waits up to 1 s
after its body returns. Here each flow's body sleeps a drawn 0-2 s (the same draws for both arms, the arms
alternating) on one temporary server; the figure is the call's wall time less the body's.

    python -m bench.flow_end [--runs 12]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench.common import fmt, summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=12, help="flow runs per arm")
    a = p.parse_args()
    from prefect import flow
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    from gpuflow.flows import prefect_api

    @flow(name="flow-end")
    def body(seconds: float) -> float:
        start = time.perf_counter()
        time.sleep(seconds)
        return time.perf_counter() - start

    def end_wait(seconds: float) -> float:
        start = time.perf_counter()
        inside = body(seconds)
        return time.perf_counter() - start - inside

    draws = random.Random(1).choices([i / 10 for i in range(21)], k=a.runs)
    waits: dict[str, list[float]] = {"Prefect's default (180 s)": [], "none (gpuflow's temporary API)": []}
    with prefect_api():
        body(0.0)  # the first run's imports and connections, in neither arm
        for seconds in draws:
            with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: 180}):
                waits["Prefect's default (180 s)"].append(end_wait(seconds))
            waits["none (gpuflow's temporary API)"].append(end_wait(seconds))
    print("| heartbeats | flow call wall - body, s, median (min-max) | mean |\n|---|---|---|")
    for arm, values in waits.items():
        print(f"| {arm} | {fmt(summary(values), 2)} | {statistics.mean(values):.2f} |")


if __name__ == "__main__":
    main()
