"""One run on several machines (`gpuflow run --nodes N`), placed through a Prefect work pool that each machine
serves with `gpuflow node`: the parent opens the MLflow run and starts a node flow run on each machine's queue;
a node that fails or never starts fails the run (the others cancelled), unless a spare may replace it.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.variables import Variable

from gpuflow.tasks.launch import TrainingFailed
from gpuflow.tasks.tracking.store import prepare_store
from gpuflow.training.contract import RunFolder
from gpuflow.training.uris import absolute_uri
from gpuflow.training.errors import UserError

from .calls import flat_parameters, one_line
from .job import PLACED_RESULT, Placement, parent_run, run_job
from .launchers import Script, Worker
from .nodeauth import idempotency_key, read_key, seal_values
from .params import PipelineParams, ScriptParams
from .rendezvous import POLL_S, NodeFailed, NodeJob, as_a_node, node_name, rdzv_variable
from .watch import watch
from .session import current_name


EXPIRY_GRACE_S = 60  # a node job's life past the parent's start deadline: clocks of the machines may differ


class NodeParams(PipelineParams):
    """A node's part of a placed run: the run's parameters, and the job."""

    job: NodeJob


# --- the parent ----------------------------------------------------------------------------


def place(launcher) -> dict:
    """The parent's part of a run with nodes > 1: one MLflow run, its nodes started and watched until all end, a
    lost machine (up to max_node_failures) replaced by a spare resuming from the last logged epoch; rank 0's result."""
    params, log = launcher.params, get_run_logger()
    key = read_key()  # before the run opens: a parent without the pool's key cannot seal its nodes' jobs
    job = job_id()
    name = current_name(params.run_name, launcher.stem)
    lost: list[tuple[str, str]] = []  # (machine, why)
    resume = resumed = None
    with parent_run(params, name, {**launcher.tags, "nodes": params.nodes}) as run:
        if params.tracking_uri.startswith("sqlite:"):
            log.warning("every node logs into %s: each machine must reach that file (a shared filesystem); "
                        "the team stack's tracking server needs none (gpuflow stack)", params.tracking_uri)
        want = params.nodes
        while True:
            machines = ready_queues(params.node_pool, want, params.min_nodes or want, lost, params.rdzv_timeout_s)
            round_id = f"{job}-r{len(lost)}" if lost else job
            run.client.set_tag(run.run_id, "machines", ",".join(machines))
            if lost:  # a spare came, or the run goes on with fewer machines
                fewer = "" if len(machines) >= want else (
                    f" ({len(machines)} of {params.nodes} machines: no spare came within {params.rdzv_timeout_s} s; "
                    "the batch split over fewer processes)")
                run.client.set_tag(run.run_id, f"node_replacement.{len(lost)}",
                                   f"lost {lost[-1][0]} ({lost[-1][1][:300]}); now on {', '.join(machines)}{fewer}; "
                                   f"{resumed}")
                run.log_metrics({"node_replacements": len(lost), "nodes": len(machines)})
                if fewer:
                    log.warning("going on without %s on %s%s", lost[-1][0], ", ".join(machines), fewer)
                want = len(machines)
            log.info("placing %d nodes of run %s on %s (%s)", want, name, ", ".join(machines),
                     f"{params.max_node_failures - len(lost)} more machine(s) may be replaced"
                     if params.max_node_failures else "a node lost fails the run")
            try:
                shrunk = len(machines) if len(machines) < params.nodes else None
                expires = time.time() + params.rdzv_timeout_s + EXPIRY_GRACE_S  # a node not started by then is lost
                jobs = [NodeJob(id=round_id, index=i, name=m, run_id=run.run_id, round=len(lost), resume=resume,
                                keep_all=params.max_node_failures > 0, nodes=shrunk, parent=flow_run.get_id(),
                                flow=launcher.node_flow, expires=expires) for i, m in enumerate(machines)]
                watch({j.name: start_node(params, j, launcher.node_flow, key) for j in jobs}, params.rdzv_timeout_s)
                break
            except NodeFailed as e:
                failed = e
            finally:  # the round's endpoint gone before anything else is said or waited for (a stop may come)
                Variable.unset(rdzv_variable(round_id))
            if len(lost) >= params.max_node_failures or failed.node is None:
                raise failed
            if failed.repeats:
                log.warning("not replacing %s: a spare would fail the same way (the job's own failure: your "
                            "code, data or values, before any progress)", failed.node)
                raise failed
            why = str(failed).splitlines()[0]
            lost.append((failed.node, why))
            resume, epoch = (None, None) if launcher.resumes_itself else last_checkpoint(run)
            resumed = "the script resumes from its own checkpoint" if launcher.resumes_itself else \
                f"resumed after epoch {epoch}"
            log.warning("%s; replacing it (%d of %d), %s", why, len(lost), params.max_node_failures, resumed)
        try:
            with tempfile.TemporaryDirectory() as d:
                result = json.loads(Path(run.client.download_artifacts(run.run_id, str(PLACED_RESULT), d)).read_text())
        except Exception as e:  # noqa: BLE001 - any store's "not there"
            raise TrainingFailed("every node finished but none logged global rank 0's result "
                                 f"({PLACED_RESULT}: {one_line(e)})") from None
    return {**result, "run_id": run.run_id, "status": "FINISHED", "node_replacements": len(lost)}


def last_checkpoint(run) -> tuple[str | None, int | None]:
    """The run's checkpoint of its last logged epoch (the relay uploads an epoch's checkpoint before
    its metrics): (its artifact path, the epoch); (None, None) before the first epoch ended."""
    logged = [m.step for m in run.client.get_metric_history(run.run_id, "train_loss")]
    if not logged:
        return None, None
    epoch = max(logged)
    path = f"checkpoints/epoch-{epoch:04d}.pt"
    if path not in {f.path for f in run.client.list_artifacts(run.run_id, "checkpoints")}:
        raise TrainingFailed(f"epoch {epoch} was logged but the run holds no {path} to resume from")
    return path, epoch


def ready_queues(pool: str, count: int, at_least: int, lost: list[tuple[str, str]], wait_s: float) -> list[str]:
    """`count` machines of the pool whose queue a worker polled in the last minute, by name, none of the `lost`
    (machine, why); once a machine was lost, waiting up to `wait_s` for them (a spare), then taking `at_least`."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    deadline = time.monotonic() + (wait_s if lost else 0)
    exclude = [m for m, _ in lost]
    with get_client(sync_client=True) as client:
        while True:
            try:
                queues = client.read_work_queues(work_pool_name=pool)
            except ObjectNotFound:
                raise UserError(f"node_pool {pool!r} does not exist on this Prefect server; run `gpuflow node "
                                f"--pool {pool}` on each machine first") from None
            ready = sorted(q.name for q in queues if q.name not in ("default", *exclude)
                           and q.status and q.status.value == "READY")
            if len(ready) >= count:
                return ready[:count]
            if time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
    if lost:
        if len(ready) >= at_least:
            return ready
        raise NodeFailed(f"node {lost[-1][0]} failed ({lost[-1][1]}) and no spare machine of node_pool {pool!r} "
                         f"came within {wait_s:g} s (online: {', '.join(ready) or 'none'}; lost: "
                         f"{', '.join(exclude)})")
    raise UserError(f"nodes={count} but node_pool {pool!r} has {len(ready)} machine(s) with a worker "
                    f"online ({', '.join(ready) or 'none'}); start `gpuflow node --pool {pool}` on more "
                    "machines, or lower nodes")


def job_id() -> str:
    """This attempt's id: the flow run's, and its attempt after a retry, whose nodes are new flow runs (their
    idempotency keys and the rendezvous Variable are named by it), never the nodes of an earlier attempt."""
    run_id = flow_run.get_id()
    if run_id is None:
        return os.urandom(8).hex()
    return run_id if flow_run.run_count <= 1 else f"{run_id}-a{flow_run.run_count}"


def start_node(params, job: NodeJob, flow_name: str, key: bytes):
    """The node's flow run on its machine's queue, its values sealed with the node key; returned at once (the parent
    watches it)."""
    from prefect.deployments import run_deployment

    # the parameters as given, so that paths resolve on the node; the store is the parent's, which every node logs into
    # (nodes as numbers: the deployment's schema takes no "MIN:MAX")
    values = dict(flow_run.get_parameters()) | {"tracking_uri": absolute_uri(params.tracking_uri),
                                                 "job": job.model_dump(), "nodes": params.nodes,
                                                 "min_nodes": params.min_nodes}
    return run_deployment(f"{flow_name}/{params.node_pool}", parameters=seal_values(values, key), timeout=0,
                          work_queue_name=job.name, idempotency_key=idempotency_key(job),
                          flow_run_name=f"{job.name}-{job.id[:8]}")


# --- the nodes ----------------------------------------------------------------------------


@flow(name="train-node", flow_run_name=node_name, validate_parameters=False)
@as_a_node
@flat_parameters(NodeParams)
def train_node(params: NodeParams) -> dict:
    """One machine's part of a placed run (started by the parent flow, never by hand). Where machines
    may be replaced, every epoch's checkpoint is kept (and uploaded to the run); a replacement round
    resumes from the run's checkpoint the parent names."""
    job, update = params.job, {}
    if job.nodes:  # the run goes on with fewer machines: the rendezvous and the batch split are this round's
        update["nodes"] = job.nodes
    if job.keep_all:
        update["keep_checkpoints"] = params.epochs
    if job.resume:
        folder = RunFolder.of(params.runs_dir, job.run_id, job.folder_name).root / "resume"
        folder.mkdir(parents=True, exist_ok=True)
        update["resume"] = prepare_store(params.tracking_uri).download_artifacts(job.run_id, job.resume, str(folder))
    return run_job(Worker(params.model_copy(update=update)), Placement(node=job))


class ScriptNodeParams(ScriptParams):
    """A node's part of a placed script run: the run's parameters, and the job."""

    job: NodeJob


@flow(name="script-node", flow_run_name=node_name, validate_parameters=False)
@as_a_node
@flat_parameters(ScriptNodeParams)
def script_node(params: ScriptNodeParams) -> dict:
    """One machine's part of a placed script run (started by the parent flow, never by hand): the
    node whose processes hold global rank 0 logs the script's files and registers its model; the
    others log their logs under nodes/<node>/. A replacement round runs the script again on every machine: it
    resumes from its own checkpoint, as under torchrun's restarts."""
    if params.job.nodes:  # the run goes on with fewer machines
        params = params.model_copy(update={"nodes": params.job.nodes})
    return run_job(Script(params), Placement(node=params.job))
