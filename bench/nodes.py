"""A run placed on two nodes vs the same job on one node with two processes.

Two `gpuflow node` machines of one pool on this host (loopback, one gloo process each), a
Prefect server already running; the same job (`gpuflow run`'s defaults: mlp on digits, 3 epochs,
seed 42) as `--nodes 2 --cpu-processes 1` and as `--cpu-processes 2`, interleaved. Reports both
walls, their ratio, and the fixed start-up cost of placement (the difference: picking machines,
the node flow runs taken by the workers, each node's probe, data and preflight, the rendezvous).

    python -m bench.nodes [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import PY, env, fmt, run, summary
from bench.overhead import last_json
from tests.servers import ServerProcess, prefect_server


def placed_and_single(tmp: Path, api: str, repeats: int) -> dict[str, list[float]]:
    common = ["--gpus", "cpu", "--tracking-uri", f"sqlite:///{tmp / 'mlflow.db'}"]
    walls: dict[str, list[float]] = {"placed": [], "single": []}
    for _ in range(repeats):
        for name, args in (("placed", ["--nodes", "2", "--cpu-processes", "1"]), ("single", ["--cpu-processes", "2"])):
            wall, out = run([PY, "-m", "gpuflow.flows", "run", *common, *args], cwd=tmp, PREFECT_API_URL=api)
            assert last_json(out)["status"] == "FINISHED"
            walls[name].append(wall)
    return walls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "prefect-home").mkdir()
        server, api = prefect_server(tmp / "prefect-home")
        with server:
            server.wait()
            nodes = []
            for name in ("node-a", "node-b"):
                (tmp / name).mkdir()
                nodes.append(ServerProcess([PY, "-m", "gpuflow.flows", "node", "--name", name], api + "/health",
                                           env(PREFECT_API_URL=api, PREFECT_HOME=str(tmp / "prefect-home")),
                                           tmp / f"{name}.log", cwd=tmp / name))
            for n in nodes:
                n.__enter__()
            try:
                time.sleep(15)  # both workers polling
                walls = placed_and_single(tmp, api, a.repeats)
            finally:
                for n in nodes:
                    n.stop()
    placed, single = summary(walls["placed"]), summary(walls["single"])
    ratio = statistics.median(walls["placed"]) / statistics.median(walls["single"])
    print(f"{os.cpu_count()} CPUs, {a.repeats} runs each, interleaved")
    print(f"placed on 2 nodes (1 process each): {fmt(placed, 1)} s")
    print(f"one node, 2 processes:              {fmt(single, 1)} s")
    print(f"ratio {ratio:.2f}; fixed start-up cost of placement "
          f"{statistics.median(walls['placed']) - statistics.median(walls['single']):+.1f} s")


if __name__ == "__main__":
    main()
