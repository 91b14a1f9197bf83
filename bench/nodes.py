"""A run placed on two nodes vs the same job on one node with two processes.

Two `gpuflow node` machines of one pool on this host (loopback, one gloo process each), a
Prefect server already running; the same job (`gpuflow run`'s defaults: mlp on digits, 3 epochs,
seed 42) as `--nodes 2 --cpu-processes 1` and as `--cpu-processes 2`, interleaved. Reports both
walls, their ratio, and the fixed start-up cost of placement (the difference: picking machines,
the node flow runs taken by the workers, each node's probe, data and preflight, the rendezvous), and two of
its phases from Prefect's states: the later node's pickup by its worker, and its flow run's process start.

    python -m bench.nodes [--repeats 3]

`--recovery` (issue #36; root: machines are network namespaces, tests/netns.py): three machines,
`--nodes 2 --max-node-failures 1`, 6 epochs. Each repeat runs the job once losing nothing and once
with the ranks of a non-zero node SIGKILLed after epoch 2 is logged. Reports the recovery time (the
loss to the first step after resume: the first resumed epoch's end, from its MLflow timestamp, less
its epoch_time_s), the work lost (whole epochs trained again, and the training since the last
checkpoint at the loss) and both walls. Goal: recovery <= 30 s plus one rendezvous, work lost <=
one checkpoint interval (one epoch).

    python -m bench.nodes --recovery [--script] [--repeats 3]

With `--script`, the job is tests/test_node_failover.py's RESUMING script (`gpuflow run --script`, 6 epochs of
about 1 s, rank 0 saving a snapshot each epoch on the host's filesystem, which every netns machine reads), which
resumes itself when the new round runs it again; an epoch's length is the gap between its epoch lines.
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

NODES = ("node-a", "node-b")  # the two machines' queues, one `gpuflow node` each


def placed_and_single(tmp: Path, api: str, repeats: int) -> dict[str, list[float]]:
    """Walls of both arms, and two phases of each placed run, from its node flow runs' states (the later node's):
    `pickup`, created to PENDING (a worker's poll), and `start`, PENDING to RUNNING (the flow run's process)."""
    common = ["--gpus", "cpu", "--tracking-uri", f"sqlite:///{tmp / 'mlflow.db'}"]
    walls: dict[str, list[float]] = {"placed": [], "single": [], "pickup": [], "start": []}
    for _ in range(repeats):
        for name, args in (("placed", ["--nodes", "2", "--cpu-processes", "1"]), ("single", ["--cpu-processes", "2"])):
            begun = time.time()
            wall, out = run([PY, "-m", "gpuflow.flows", "run", *common, *args], cwd=tmp, PREFECT_API_URL=api)
            assert last_json(out)["status"] == "FINISHED"
            walls[name].append(wall)
            if name == "placed":
                for phase, seconds in node_phases(api, begun).items():
                    walls[phase].append(seconds)
    return walls


def node_phases(api: str, since: float) -> dict[str, float]:
    """The later node's pickup and start (see placed_and_single) among the node flow runs created after `since`."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    phases: dict[str, float] = {"pickup": 0.0, "start": 0.0}
    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        for fr in client.read_flow_runs():
            if fr.work_queue_name in NODES and fr.created.timestamp() > since:
                at = {s.type.value: s.timestamp.timestamp() for s in client.read_flow_run_states(fr.id)}
                phases["pickup"] = max(phases["pickup"], at["PENDING"] - fr.created.timestamp())
                phases["start"] = max(phases["start"], at["RUNNING"] - at["PENDING"])
    return phases


RECOVERY_JOB = ["--gpus", "cpu", "--cpu-processes", "1", "--nodes", "2", "--max-node-failures", "1",
                "--dataset", "synthetic", "--synthetic-size", "20000", "--epochs", "6", "--seed", "3"]


def _history(client, name: str, metric: str) -> list:
    exp = client.get_experiment_by_name("gpuflow")
    runs = client.search_runs(exp.experiment_id, f"tags.`mlflow.runName` = '{name}'") if exp else []
    return client.get_metric_history(runs[0].info.run_id, metric) if runs else []


def one_recovery(cluster, folder: Path, lose: bool, script: bool) -> dict:
    """One placed run (gpuflow's worker, or with `script` a torchrun script that resumes from its own snapshot);
    with `lose`, the ranks of its second machine killed once epoch 2 is logged."""
    import mlflow

    from tests.test_node_failover import RESUMING
    from tests.test_nodes import finished, gpuflow, kill_ranks

    folder.mkdir()
    name, metric = folder.name, "loss" if script else "train_loss"
    own = ["--node-pool", cluster.pool, "--run-name", name]
    if script:  # the same machines and failures; the script's own epochs
        (folder / "resuming.py").write_text(RESUMING)
        args = [*RECOVERY_JOB[:8], *own, "--script", str(folder / "resuming.py"), "--", str(folder / "snapshot.pt")]
    else:
        args = [*RECOVERY_JOB, *own]
    start = time.monotonic()
    proc = gpuflow(cluster, folder, *args)
    client = mlflow.MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    killed = None
    while lose and killed is None:
        assert proc.poll() is None and time.monotonic() - start < 600, proc.communicate()[1][-3000:]
        logged = _history(client, name, metric)
        if len(logged) >= 2:
            run = client.search_runs(client.get_experiment_by_name("gpuflow").experiment_id,
                                     f"tags.`mlflow.runName` = '{name}'")[0]
            victim = run.data.tags["machines"].split(",")[1]  # not node 0
            killed, last = time.time(), max(m.timestamp for m in logged) / 1000
            kill_ranks(cluster.node(victim))
            before = max(m.step for m in logged)
        time.sleep(0.2)
    code, out, err = finished(proc, timeout=600)
    assert code == 0, err[-3000:]
    result = {"wall": time.monotonic() - start}
    if lose:
        history = sorted(client.get_metric_history(out["run_id"], metric), key=lambda m: m.timestamp)
        if script:  # the new round's first line: the one after the longest gap (an epoch in progress at the loss
            # may still end and log in the old round); an epoch: the median gap before the loss
            after = max(zip(history, history[1:]), key=lambda pair: pair[1].timestamp - pair[0].timestamp)[1]
            took = statistics.median((b.timestamp - a.timestamp) / 1000 for a, b in zip(history, history[1:])
                                     if b.timestamp <= last * 1000)
            redone = len(history) - len({m.step for m in history})  # epochs logged again: trained again
        else:
            resumed = int(client.get_run(out["run_id"]).data.tags["node_replacement.1"].rsplit(
                "resumed after epoch ", 1)[1])
            after = min((m for m in history if m.step > resumed), key=lambda m: m.step)
            took = {m.step: m.value for m in client.get_metric_history(out["run_id"], "epoch_time_s")}[after.step]
            redone = max(0, before - resumed)
        result.update(recovery=after.timestamp / 1000 - took - killed, redone=redone, since_checkpoint=killed - last,
                      epoch=took)
    return result


def recovery(tmp: Path, repeats: int, script: bool) -> None:
    from tests.netns import two_nodes

    rows: dict[str, list[dict]] = {"none lost": [], "one lost": []}
    with two_nodes(tmp, names=("node-a", "node-b", "node-c"), gpuflow_node=True,
                   GPUFLOW_ALLOW_PATHS=str(tmp)) as cluster:
        for i in range(repeats):
            for label, lose in (("none lost", False), ("one lost", True)):
                rows[label].append(one_recovery(cluster, tmp / f"run-{i}-{int(lose)}", lose, script))
                print(label, {k: round(v, 2) for k, v in rows[label][-1].items()}, flush=True)
    lost, kept = rows["one lost"], rows["none lost"]
    what = "a script that resumes from its own snapshot" if script else "gpuflow's worker"
    print(f"{os.cpu_count()} CPUs, {repeats} repeats, 3 machines (netns), --nodes 2 --max-node-failures 1, 6 epochs, "
          f"{what}")
    print(f"wall, nothing lost:           {fmt(summary([r['wall'] for r in kept]), 1)} s")
    print(f"wall, one machine lost:       {fmt(summary([r['wall'] for r in lost]), 1)} s")
    print(f"recovery (loss to first step after resume): {fmt(summary([r['recovery'] for r in lost]), 1)} s")
    print(f"epochs trained again:         {fmt(summary([r['redone'] for r in lost]))}")
    print(f"training lost at the loss (since the last checkpoint): "
          f"{fmt(summary([r['since_checkpoint'] for r in lost]), 1)} s; one epoch "
          f"{fmt(summary([r['epoch'] for r in lost]), 1)} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--recovery", action="store_true", help="the time to recover from a lost machine (root)")
    p.add_argument("--script", action="store_true", help="with --recovery: a torchrun script that resumes itself")
    a = p.parse_args()
    if a.recovery:
        with tempfile.TemporaryDirectory() as d:
            return recovery(Path(d), a.repeats, a.script)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "prefect-home").mkdir()
        server, api = prefect_server(tmp / "prefect-home")
        with server:
            server.wait()
            nodes = []
            for name in NODES:
                (tmp / name).mkdir()
                nodes.append(ServerProcess([PY, "-m", "gpuflow.flows", "node", "--name", name], api + "/health",
                                           # the runs' shared store, tmp/mlflow.db, is in a folder it may use
                                           env(PREFECT_API_URL=api, PREFECT_HOME=str(tmp / "prefect-home"),
                                               GPUFLOW_ALLOW_PATHS=str(tmp)),
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
    print(f"of which, the later node: its worker's pickup {fmt(summary(walls['pickup']), 2)} s, its flow run's "
          f"process to RUNNING {fmt(summary(walls['start']), 2)} s")


if __name__ == "__main__":
    main()
