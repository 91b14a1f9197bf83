"""A run placed on several machines (flows/nodes.py): two machines stood up on this host as network
namespaces with their own addresses (tests/netns.py), each running `gpuflow node`; the run is
started from the root namespace with `gpuflow run --nodes 2`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gpuflow.tasks.tracking.store import open_store  # under gpuflow's lock: a run may be creating the file
from tests.netns import two_nodes

pytestmark = pytest.mark.slow

JOB = ["--gpus", "cpu", "--epochs", "2", "--seed", "7", "--dataset", "digits", "--model", "mlp"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # the tests' scripts live in their tmp folders, which the nodes' allowlist must take
    with two_nodes(tmp_path_factory.mktemp("nodes"), gpuflow_node=True,
                   GPUFLOW_ALLOW_PATHS=str(tmp_path_factory.getbasetemp())) as c:
        yield c


def gpuflow(cluster, tmp: Path, *args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gpuflow.flows", "run", *args,
                             "--tracking-uri", f"sqlite:///{tmp / 'mlflow.db'}"], cwd=tmp,
                            env=cluster.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **popen)


def finished(proc: subprocess.Popen, timeout: float = 420) -> tuple[int, dict | None, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, (json.loads(out[out.index("{"):]) if proc.returncode == 0 else None), err


def weights(path: str) -> dict:
    return torch.load(path, weights_only=True)["model"]


def test_a_run_placed_on_two_nodes_trains_as_one_node_with_two_processes(cluster, tmp_path):
    code, placed, err = finished(gpuflow(cluster, tmp_path, *JOB, "--nodes", "2", "--cpu-processes", "1",
                                         "--node-pool", cluster.pool))
    assert code == 0, err[-4000:]
    code, single, err1 = finished(gpuflow(cluster, tmp_path, *JOB, "--cpu-processes", "2"))
    assert code == 0, err1[-4000:]
    assert placed["world_size"] == single["world_size"] == 2
    for k in ("train_loss", "val_loss", "val_accuracy"):
        assert placed["final_metrics"][k] == pytest.approx(single["final_metrics"][k], rel=1e-6, abs=1e-7), k
    a, b = weights(placed["checkpoint"]), weights(single["checkpoint"])
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)

    # each node launched from its own address; both joined node 0's published endpoint
    net = {n.name: n.addr for n in cluster.nodes}
    found = re.findall(r"\[(node-[ab])\] launching: .*?--node-rank=(\d) --master-addr=(\S+) --master-port=\d+ "
                       r"--local-addr=(\S+)", err)  # torchrun's static rendezvous: no state unpickled from a store
    launches = {n: (rank, master, addr) for n, rank, master, addr in found}
    assert {n: addr for n, (_, _, addr) in launches.items()} == net, err[-4000:]
    assert {master for _, master, _ in launches.values()} == {net["node-a"]}  # node 0 hosts the store
    assert {n: rank for n, (rank, _, _) in launches.items()} == {"node-a": "0", "node-b": "1"}

    # one MLflow run, owned by the parent, with both nodes' environments and rank 0's results
    client = open_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run(placed["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["nodes"] == "2"
    assert run.data.tags["machines"] == "node-a,node-b" and run.data.params["world_size"] == "2"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")] == [1, 2]
    envs = {f.path for f in client.list_artifacts(run.info.run_id, "environment")}
    assert envs == {"environment/node-a", "environment/node-b"}
    assert placed["model_version"] and client.get_model_version("gpuflow-model", placed["model_version"]).run_id \
        == run.info.run_id
    assert len(client.search_runs([run.info.experiment_id])) == 2  # the placed run and the single one


SCRIPT = """
import os, torch, torch.distributed as dist
from gpuflow.training import helper
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1, 4):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    helper.report({"loss": loss.item()}, step=step)
if dist.get_rank() == 0:
    torch.save(model.state_dict(), os.path.join(helper.output_dir(), "model.pt"))
print(f"rank {dist.get_rank()} of {dist.get_world_size()}, master {os.environ['MASTER_ADDR']}")
dist.barrier()
dist.destroy_process_group()
"""


def test_an_unchanged_torchrun_script_runs_on_two_nodes_in_one_run(cluster, tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    code, out, err = finished(gpuflow(cluster, tmp_path, "--script", str(tmp_path / "train.py"), "--gpus", "cpu",
                                      "--cpu-processes", "1", "--nodes", "2", "--node-pool", cluster.pool))
    assert code == 0, err[-4000:]
    assert out["world_size"] == 2 and out["outputs"] == ["model.pt"] and out["checkpoint"]
    masters = set(re.findall(r"rank \d of 2, master (\S+)", err))
    assert len(masters) == 1 and masters <= {n.addr for n in cluster.nodes}, err[-3000:]  # rank 0's node
    client = open_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run(out["run_id"])
    assert run.info.status == "FINISHED" and run.data.params["gpuflow.world_size"] == "2"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3]
    logged = {f.path for f in client.list_artifacts(run.info.run_id)}
    assert {"outputs", "logs", "nodes", "environment"} <= logged  # the other node's logs under nodes/


def test_a_machine_whose_worker_is_gone_fails_the_run_by_its_start_deadline(cluster, tmp_path):
    """...and the two live nodes' cancellation loads no code from their deployment, whose pull steps an API caller
    set to run a command (Prefect's own executor runs them in the worker, to find a flow's hooks)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate

    marker = tmp_path / "pulled"
    with cluster.client_settings(), get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(f"train-node/{cluster.pool}")
        client.update_deployment(deployment.id, DeploymentUpdate(pull_steps=[
            {"prefect.deployments.steps.run_shell_script": {"script": f"touch {marker}"}}]))

    with cluster.client_settings(), get_client(sync_client=True) as client:
        client.create_work_queue(name="node-c", work_pool_name=cluster.pool, concurrency_limit=1)
        # a worker polled node-c once, then its machine went away: the queue still reads READY
        client.get_scheduled_flow_runs_for_work_pool(cluster.pool, work_queue_names=["node-c"])
        deadline = time.monotonic() + 60  # the server marks it so a moment later (later still under load: CI10)
        while client.read_work_queue_by_name("node-c", work_pool_name=cluster.pool).status.value != "READY":
            assert time.monotonic() < deadline
            time.sleep(0.5)
    start = time.monotonic()
    code, _, err = finished(gpuflow(cluster, tmp_path, *JOB, "--nodes", "3", "--cpu-processes", "1",
                                    "--node-pool", cluster.pool, "--rdzv-timeout-s", "20"))
    assert code == 1 and "gpuflow run: node node-c did not start within 20 s" in err, err[-3000:]
    assert time.monotonic() - start < 120
    with cluster.client_settings(), get_client(sync_client=True) as client:
        client.delete_work_queue_by_id(client.read_work_queue_by_name("node-c", work_pool_name=cluster.pool).id)
    client = open_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("gpuflow").experiment_id])
    assert run.info.status == "FAILED"
    deadline = time.monotonic() + 60  # the two live nodes were cancelled: nothing of theirs trains on
    while (left := _ranks([p for n in cluster.nodes for p in n.pids()])) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, left
    with cluster.client_settings(), get_client(sync_client=True) as prefect:
        live = [r for r in prefect.read_flow_runs() if r.parameters.get("job", {}).get("run_id") == run.info.run_id
                and r.name.startswith(("node-a-", "node-b-"))]
        ended = sorted(r.state.type.value for r in live)
        assert ended == ["CANCELLED", "CANCELLED"], [(r.name, r.state) for r in live]
        prefect.update_deployment(deployment.id, DeploymentUpdate(pull_steps=deployment.pull_steps or []))
    assert not marker.exists()


def replaceable_run_training(cluster, tmp_path: Path, name: str, rdzv_timeout_s: int, nodes: str = "2",
                             epochs: int = 50):
    """`gpuflow run --nodes 2 --max-node-failures 1` on the two machines, once its first epoch is
    logged: (the process, its MLflow client)."""
    proc = gpuflow(cluster, tmp_path, "--gpus", "cpu", "--cpu-processes", "1", "--nodes", nodes,
                   "--max-node-failures", "1", "--rdzv-timeout-s", str(rdzv_timeout_s), "--node-pool", cluster.pool,
                   "--dataset", "synthetic", "--synthetic-size", "20000", "--epochs", str(epochs), "--run-name", name)
    client = open_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    deadline = time.monotonic() + 300
    while not _training(client, name):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-4000:]
        time.sleep(1)
    return proc, client


def test_with_no_spare_machine_a_lost_node_fails_the_run_within_the_timeout_naming_it(cluster, tmp_path):
    """--max-node-failures 1 on a pool of exactly two machines: one machine's ranks die mid-run, no
    third machine comes within --rdzv-timeout-s, and the run fails naming what was lost."""
    proc, client = replaceable_run_training(cluster, tmp_path, "no-spare", rdzv_timeout_s=15)
    kill_ranks(cluster.node("node-b"))  # its `gpuflow node` stays: the pool still has two machines, no third
    killed = time.monotonic()
    code, _, err = finished(proc, timeout=240)
    last = err.strip().splitlines()[-1]
    assert code == 1 and "and no spare machine of node_pool" in last and "within 15 s" in last, err[-4000:]
    assert "lost: node-" in last and time.monotonic() - killed < 15 + 60, last
    (run,) = client.search_runs(client.get_experiment_by_name("gpuflow").experiment_id,
                                "tags.`mlflow.runName` = 'no-spare'")
    assert run.info.status == "FAILED" and "node_replacements" not in run.data.metrics
    deadline = time.monotonic() + 60  # nothing of either machine trains on
    while (left := _ranks([p for n in cluster.nodes for p in n.pids()])) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, left


def test_with_nodes_1_2_and_no_spare_the_run_goes_on_on_one_machine_from_its_last_checkpoint(cluster, tmp_path):
    """--nodes 1:2: one machine's ranks die, no third machine comes within --rdzv-timeout-s, and the
    run goes on on the other machine alone (the batch split over one process), in the same MLflow run."""
    proc, client = replaceable_run_training(cluster, tmp_path, "shrinks", rdzv_timeout_s=15, nodes="1:2", epochs=6)
    kill_ranks(cluster.node("node-b"))
    code, out, err = finished(proc, timeout=300)
    assert code == 0, err[-5000:]
    run = client.get_run(out["run_id"])
    assert run.info.status == "FINISHED" and out["node_replacements"] == 1 and out["world_size"] == 1, out
    assert run.data.metrics["nodes"] == 1 and run.data.params["min_nodes"] == "1"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")] == [1, 2, 3, 4, 5, 6]
    told = run.data.tags["node_replacement.1"]
    assert told.startswith("lost node-b") and "now on node-a (1 of 2 machines: no spare came within 15 s" in told, told
    assert "going on without node-b on node-a" in err, err[-3000:]
    assert out["model_version"]


# Ctrl-C, and SIGTERM: what a Prefect worker or `gpuflow serve` sends the parent's process when its
# flow run is cancelled in Prefect (the UI, `prefect flow-run cancel`).
@pytest.mark.parametrize("stop, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_stopping_the_parent_while_a_lost_machine_waits_for_its_spare_leaves_nothing(cluster, tmp_path, stop, code):
    """The parent waits (up to --rdzv-timeout-s) for a spare to replace a lost machine; a Ctrl-C or a
    SIGTERM then ends the command within seconds: the run KILLED, no node's run open, no rank, no rendezvous."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + 300  # for the start and the replacement both, as the helper's own
    name = f"stop-{stop.name.lower()}"
    proc, client = replaceable_run_training(cluster, tmp_path, name, rdzv_timeout_s=240)
    (run,) = client.search_runs(client.get_experiment_by_name("gpuflow").experiment_id,
                                f"tags.`mlflow.runName` = '{name}'")
    parent = run.data.tags["prefect.flow_run_id"]
    kill_ranks(cluster.node("node-b"))
    with cluster.client_settings(), get_client(sync_client=True) as prefect:
        while not any("replacing it" in line.message for line in prefect.read_logs(
                LogFilter(flow_run_id=LogFilterFlowRunId(any_=[parent])))):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-4000:]
            time.sleep(0.5)
        proc.send_signal(stop)  # the parent now waits for a third machine that never comes
        stopped = time.monotonic()
        exit_code, _, err = finished(proc, timeout=120)
        assert exit_code == code and time.monotonic() - stopped < 30, err[-3000:]
        nodes = [r for r in prefect.read_flow_runs() if r.name.startswith(("node-a-", "node-b-"))
                 and r.name.endswith(str(parent)[:8])]  # this run's node jobs: <machine>-<job id>
        assert nodes and all(r.state.is_final() for r in nodes), [(r.name, r.state.type) for r in nodes]
        assert not [v.name for v in prefect.read_variables() if v.name.startswith("gpuflow-rdzv-")]
        assert prefect.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[parent])))[0] \
            .state.is_final()
    assert client.get_run(run.info.run_id).info.status == "KILLED"
    deadline = time.monotonic() + 60
    while (left := _ranks([p for n in cluster.nodes for p in n.pids()])) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, left


def kill_ranks(node) -> None:
    """torchrun and the rank of one machine, SIGKILL; its `gpuflow node` stays."""
    for pid in node.pids():
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"torch.distributed.run" in cmd or b"gpuflow.training" in cmd and b"--config" in cmd:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# --- the node's door: only jobs a placed run's parent sealed (flows/nodeauth.py, flows/nodeworker.py) ----------


def _wait_final(client, run_id, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while not (run := client.read_flow_run(run_id)).state.is_final():
        assert time.monotonic() < deadline, (run.name, run.state)
        time.sleep(0.5)
    return run


def test_a_node_runs_no_command_job_variable_or_forged_job_and_its_queue_stays_free(cluster, tmp_path):
    """As an API caller without the node key: a node run with a command and an environment in its job variables, a
    job without a seal, one sealed and then changed, one left PENDING: none starts a process (no marker), each ends
    at once, and a real placed run then runs on the same queues; a job of that run sent again is refused."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.states import Pending

    from gpuflow.flows.nodeauth import read_key, seal_values

    marker = tmp_path / "pwned"
    job = {"id": "forged-job", "index": 0, "name": "node-a", "run_id": "0" * 32, "expires": time.time() + 600}
    hostile = {"command": f"sh -c 'id > {marker}'",
               "env": {"GPUFLOW_POLICY_FILE": "/dev/null", "PYTHONPATH": str(tmp_path), "LD_PRELOAD": "/x.so"},
               "working_dir": str(tmp_path)}
    sealed = seal_values({"job": job, "epochs": 1}, read_key(cluster.node_key))
    altered = {**sealed, "model": f"{tmp_path / 'evil.py'}:Net"}
    with cluster.client_settings(), get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(f"train-node/{cluster.pool}")
        runs = [client.create_flow_run_from_deployment(deployment.id, parameters=values, work_queue_name="node-a",
                                                       job_variables=hostile)
                for values in ({"job": job}, altered)]
        held = client.create_flow_run_from_deployment(deployment.id, parameters={"job": job}, state=Pending(),
                                                      work_queue_name="node-b")
        ended = [_wait_final(client, r.id) for r in runs]
        for run, why in zip(ended, ("without a sealed job", "no holder of this pool's node key sealed")):
            assert run.state.type.value == "CRASHED" and why in run.state.message, run.state
            assert run.infrastructure_pid is None  # refused before any process started
        assert not marker.exists()
        # the placed run the caller could not start (a parent with the key) runs on both queues, one held PENDING
        proc = gpuflow(cluster, tmp_path, *JOB, "--nodes", "2", "--cpu-processes", "1", "--node-pool", cluster.pool)
        shown = set()  # every process's arguments while it runs, as `ps` shows them to any account
        while proc.poll() is None:
            ps = subprocess.run(["ps", "-eww", "-o", "args="], capture_output=True, text=True)
            shown |= set(ps.stdout.splitlines())
            time.sleep(0.5)
        code, placed, err = finished(proc)
        assert code == 0 and placed["world_size"] == 2, err[-4000:]
        assert any("gpuflow.flows.nodeworker" in line for line in shown)
        assert not [line for line in shown if cluster.node_key.read_text().strip() in line]
        assert client.read_flow_run(held.id).state.is_pending()  # still there, holding nothing
        client.delete_flow_run(held.id)
        # one of its node jobs, copied with its seal intact and sent again: refused, nothing runs
        (done,) = [r for r in client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(
            like_="node-a-"))) if r.parameters.get("job", {}).get("run_id") == placed["run_id"]]
        again = client.create_flow_run_from_deployment(done.deployment_id, parameters=done.parameters,
                                                       work_queue_name="node-a")
        run = _wait_final(client, again.id, timeout=120)
    assert run.state.type.value == "CRASHED" and "refused a copy of node 0 of job" in run.state.message, run.state
    assert run.infrastructure_pid is None
    assert cluster.node_key.read_text().strip() not in err  # the key is never shown


def test_a_follower_joins_only_the_endpoint_node_0_sealed(cluster):
    """Any API user may write the rendezvous Variable: a follower passes over an endpoint without node 0's seal."""
    from prefect import flow
    from prefect.variables import Variable

    from gpuflow.flows.nodeauth import read_key, seal_endpoint
    from gpuflow.flows.rendezvous import NO_ENDPOINT, NodeFailed, NodeJob, rdzv_variable, rendezvous

    job = NodeJob(id="rdzv-test", index=1, name="node-b", run_id="0" * 32)

    @flow
    def follow():
        return rendezvous(job, 2, timeout_s=3).endpoint

    os.environ["GPUFLOW_NODE_KEY"] = str(cluster.node_key)
    try:
        with cluster.client_settings():
            Variable.set(rdzv_variable(job.id), "127.0.0.1:29999", overwrite=True)  # a caller's listener
            with pytest.raises(NodeFailed, match=NO_ENDPOINT):
                follow()
            other_round = seal_endpoint("another-round", "127.0.0.1:29998", read_key())
            Variable.set(rdzv_variable(job.id), other_round, overwrite=True)  # node 0's of another round: replayed
            with pytest.raises(NodeFailed, match=NO_ENDPOINT):
                follow()
            Variable.set(rdzv_variable(job.id), seal_endpoint(job.id, "10.0.0.1:4000", read_key()), overwrite=True)
            assert follow() == "10.0.0.1:4000"
            Variable.unset(rdzv_variable(job.id))
    finally:
        del os.environ["GPUFLOW_NODE_KEY"]


# kills node-b's worker: the module's last test
def test_a_node_killed_mid_run_fails_the_run_and_the_other_node_stops(cluster, tmp_path):
    proc = gpuflow(cluster, tmp_path, "--gpus", "cpu", "--cpu-processes", "1", "--nodes", "2",
                   "--node-pool", cluster.pool, "--dataset", "synthetic", "--synthetic-size", "20000",
                   "--epochs", "50", "--run-name", "to-kill")
    client = open_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    deadline = time.monotonic() + 300
    while not _training(client):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-4000:]
        time.sleep(1)
    cluster.kill_node("node-b")  # its worker, its flow run, torchrun and the rank: gone at once
    code, _, err = finished(proc, timeout=240)
    assert code == 1, err[-4000:]
    assert "gpuflow run: node node-b failed: its machine stopped answering" in err, err[-3000:]  # not its peer
    (run,) = client.search_runs(client.get_experiment_by_name("gpuflow").experiment_id,
                                "tags.`mlflow.runName` = 'to-kill'")
    assert run.info.status == "FAILED"
    deadline = time.monotonic() + 60
    while (left := _ranks(cluster.node("node-a").pids())) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, left  # node-a's torchrun and rank stopped with their peer


def _training(client, name: str = "to-kill") -> bool:
    exp = client.get_experiment_by_name("gpuflow")
    runs = client.search_runs(exp.experiment_id, f"tags.`mlflow.runName` = '{name}'") if exp else []
    return bool(runs and client.get_metric_history(runs[0].info.run_id, "train_loss"))


def _ranks(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "torch.distributed.run" in cmd or "-m gpuflow.training --config" in cmd:  # not `gpuflow node`'s reaper
            out.append(cmd[:200])
    return out
