"""A placed run that loses a machine (issue #36): three machines on this host as network namespaces
(tests/netns.py), `gpuflow run --nodes 2 --max-node-failures 1`; one machine's ranks, or the whole
machine, killed mid-run; the spare takes its place and the run resumes in the same MLflow run."""

from __future__ import annotations

import time

import pytest

from gpuflow.tasks.tracking.store import open_store  # under gpuflow's lock: a run may be creating the file
from tests.netns import two_nodes
from tests.test_nodes import finished, gpuflow, kill_ranks

pytestmark = pytest.mark.slow

JOB = ["--gpus", "cpu", "--cpu-processes", "1", "--nodes", "2", "--max-node-failures", "1",
       "--dataset", "synthetic", "--synthetic-size", "20000", "--epochs", "6", "--seed", "3"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with two_nodes(tmp_path_factory.mktemp("failover"), names=("node-a", "node-b", "node-c"), gpuflow_node=True,
                   GPUFLOW_ALLOW_PATHS=str(tmp_path_factory.getbasetemp())) as c:
        yield c


def _epochs(client, name: str) -> list[int]:
    exp = client.get_experiment_by_name("gpuflow")
    runs = client.search_runs(exp.experiment_id, f"tags.`mlflow.runName` = '{name}'") if exp else []
    return [m.step for m in client.get_metric_history(runs[0].info.run_id, "train_loss")] if runs else []


# A torchrun script that saves and resumes from its own snapshot, at a path every machine reads (here the
# host's filesystem; a shared one on real machines), as torchrun's elastic restarts require of it.
RESUMING = """
import os, sys, time, torch, torch.distributed as dist
from gpuflow.training import helper
snapshot = sys.argv[1]
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
first = 1
if os.path.exists(snapshot):
    saved = torch.load(snapshot, weights_only=True)
    model.load_state_dict(saved["model"])
    first = saved["epoch"] + 1
ddp = torch.nn.parallel.DistributedDataParallel(model)
for epoch in range(first, 7):
    for _ in range(20):
        loss = ddp(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
    time.sleep(1)
    if dist.get_rank() == 0:
        torch.save({"model": model.state_dict(), "epoch": epoch}, snapshot + ".tmp")
        os.replace(snapshot + ".tmp", snapshot)
        helper.report({"loss": loss.item()}, step=epoch)
    dist.barrier()
if dist.get_rank() == 0:
    torch.save(model.state_dict(), os.path.join(helper.output_dir(), "model.pt"))
dist.destroy_process_group()
"""


def test_a_script_that_resumes_itself_survives_a_lost_machine_in_the_same_mlflow_run(cluster, tmp_path):
    """--script with --max-node-failures 1: node-b's ranks die mid-run, the spare takes its place, and
    the script, run again on every machine of the new round, resumes from its own snapshot. (First in the
    module: the test after it kills node-a whole, and the three machines are the module's.)"""
    (tmp_path / "resuming.py").write_text(RESUMING)
    proc = gpuflow(cluster, tmp_path, "--script", str(tmp_path / "resuming.py"), "--gpus", "cpu",
                   "--cpu-processes", "1", "--nodes", "2", "--max-node-failures", "1", "--node-pool", cluster.pool,
                   "--run-name", "script-failover", "--", str(tmp_path / "snapshot.pt"))
    client = open_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    deadline = time.monotonic() + 300

    def logged() -> list[int]:
        exp = client.get_experiment_by_name("gpuflow")
        runs = client.search_runs(exp.experiment_id, "tags.`mlflow.runName` = 'script-failover'") if exp else []
        return [m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")] if runs else []

    while not logged():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-4000:]
        time.sleep(0.5)
    kill_ranks(cluster.node("node-b"))
    code, out, err = finished(proc, timeout=480)
    assert code == 0, err[-5000:]
    run = client.get_run(out["run_id"])
    assert run.info.status == "FINISHED" and out["node_replacements"] == 1 and out["outputs"] == ["model.pt"]
    assert logged() == [1, 2, 3, 4, 5, 6]  # each epoch once: the new round resumed from the snapshot
    told = run.data.tags["node_replacement.1"]
    assert told.startswith("lost node-b") and told.endswith("the script resumes from its own checkpoint"), told
    assert "node-c" in run.data.tags["machines"], run.data.tags


@pytest.mark.parametrize("lose", ["the ranks of node-b", "node-a, node 0, whole"])
def test_a_lost_machine_is_replaced_by_the_spare_and_the_run_resumes_in_the_same_mlflow_run(cluster, tmp_path, lose):
    name = "failover-" + lose.split()[-1]
    proc = gpuflow(cluster, tmp_path, *JOB, "--node-pool", cluster.pool, "--run-name", name)
    client = open_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    deadline = time.monotonic() + 300
    while not _epochs(client, name):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-4000:]
        time.sleep(0.5)
    if lose.startswith("the ranks"):
        kill_ranks(cluster.node("node-b"))
    else:
        cluster.kill_node("node-a")  # its worker too: the machine stops answering
    code, out, err = finished(proc, timeout=480)
    assert code == 0, err[-5000:]
    run = client.get_run(out["run_id"])
    assert run.info.status == "FINISHED" and out["node_replacements"] == 1
    assert run.data.metrics["node_replacements"] == 1
    assert _epochs(client, name) == [1, 2, 3, 4, 5, 6]  # each epoch once: the new round resumed, not restarted
    told = run.data.tags["node_replacement.1"]
    resumed = int(told.rsplit("resumed after epoch ", 1)[1])
    assert told.startswith("lost node-") and 1 <= resumed < 6, told
    assert "node-c" in run.data.tags["machines"], run.data.tags  # the spare took a place
    assert out["model_version"] and client.get_model_version("gpuflow-model", out["model_version"]).run_id \
        == run.info.run_id  # registered from the same run


def test_a_failure_every_machine_would_repeat_is_not_retried_on_a_spare(cluster, tmp_path):
    """fp16 on CPU machines: each node's assignment refuses it, as a spare's would: no spare is
    taken, the run fails at once with the cause."""
    proc = gpuflow(cluster, tmp_path, *JOB, "--precision", "fp16", "--node-pool", cluster.pool,
                   "--run-name", "fails-everywhere")
    code, _, err = finished(proc, timeout=300)
    last = err.strip().splitlines()[-1]
    assert code == 1 and "precision 'fp16' needs CUDA" in last, err[-3000:]
    assert "not replacing node-" in err and "replacing it (1 of 1)" not in err, err[-3000:]
    client = open_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("gpuflow").experiment_id])
    assert run.info.status == "FAILED" and "node_replacements" not in run.data.metrics
