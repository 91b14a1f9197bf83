"""One run on several machines, placed through a Prefect work pool.

    gpuflow node --pool gpuflow-nodes          # on each machine: its queue, and a worker on it
    gpuflow run --nodes 2 --gpus 4 ...         # anywhere: one run on two of those machines

Each machine serves one queue of the pool (named after it, concurrency 1) with a Prefect
process worker. The parent flow (train-pipeline or train-script with nodes > 1) opens the MLflow
run, picks machines whose queue a worker polls, and starts one node flow run on each queue. A
node is a placement of the one job function (flows/job.py): it probes and assigns its own cards
and holds their locks as a single-machine run does, joins the rendezvous (flows/rendezvous.py)
and the parent's run. The node whose processes hold global rank 0 (torchrun decides) relays the
metrics, logs the results, registers the model, and logs its result into the run, where the
parent reads it once every node has completed.

A node that fails, or never starts (no worker polls its queue), fails the run with the node
named; the parent cancels the others, and a node whose peers are gone stops within a second
(c10d). Nothing keeps training alone. Restarts are off across machines: run it again.
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
from gpuflow.training.uris import absolute_uri
from gpuflow.training.errors import UserError

from .calls import one_line
from .job import PLACED_RESULT, Placement, parent_run, run_job
from .launchers import Script, Worker
from .calls import flat_parameters
from .params import PipelineParams, ScriptParams
from .rendezvous import POLL_S, NodeFailed, NodeJob, in_node_folder, node_name, variable
from .session import current_name
CANCEL_GRACE_S = 10.0  # a node's machine answers a cancellation within it, or is taken for gone
DONE = {"COMPLETED"}
ENDED = {"FAILED", "CRASHED", "CANCELLED", "CANCELLING"}
WAITING = {"SCHEDULED", "PENDING", "LATE", "AWAITINGRETRY", "PAUSED"}


class NodeParams(PipelineParams):
    """A node's part of a placed run: the run's parameters, and the job."""

    job: NodeJob


# --- the parent ----------------------------------------------------------------------------


def place(launcher) -> dict:
    """The parent's part of a run with nodes > 1: machines picked, one MLflow run, the nodes
    started and watched until every one has ended; rank 0's node's result, read from the run."""
    params, log = launcher.params, get_run_logger()
    machines = ready_queues(params.node_pool, params.nodes)
    job = flow_run.get_id() or os.urandom(8).hex()
    name = current_name(params.run_name, launcher.stem)
    tags = {**launcher.tags, "nodes": params.nodes, "machines": ",".join(machines)}
    try:
        with parent_run(params, name, tags) as run:
            log.info("placing %d nodes of run %s on %s (max_restarts and launch_retries apply on one machine: "
                     "a node lost fails the run)", params.nodes, name, ", ".join(machines))
            if params.tracking_uri.startswith("sqlite:"):
                log.warning("every node logs into %s: each machine must reach that file (a shared filesystem); "
                            "the team stack's tracking server needs none (gpuflow stack)", params.tracking_uri)
            children = {m: start_node(params, NodeJob(id=str(job), index=i, name=m, run_id=run.run_id),
                                      launcher.node_flow) for i, m in enumerate(machines)}
            watch(children, params.rdzv_timeout_s)
            try:
                with tempfile.TemporaryDirectory() as d:
                    result = json.loads(Path(run.client.download_artifacts(run.run_id, str(PLACED_RESULT), d))
                                        .read_text())
            except Exception as e:  # noqa: BLE001 - any store's "not there"
                raise TrainingFailed("every node finished but none logged global rank 0's result "
                                     f"({PLACED_RESULT}: {one_line(e)})") from None
    finally:
        Variable.unset(variable("rdzv", str(job)))
    return {**result, "run_id": run.run_id, "status": "FINISHED"}


def ready_queues(pool: str, count: int) -> list[str]:
    """`count` machines of the pool whose queue a worker polled in the last minute, by name."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            queues = client.read_work_queues(work_pool_name=pool)
        except ObjectNotFound:
            raise UserError(f"node_pool {pool!r} does not exist on this Prefect server; run `gpuflow node "
                            f"--pool {pool}` on each machine first") from None
    ready = sorted(q.name for q in queues if q.name != "default" and q.status and q.status.value == "READY")
    if len(ready) < count:
        raise UserError(f"nodes={count} but node_pool {pool!r} has {len(ready)} machine(s) with a worker "
                        f"online ({', '.join(ready) or 'none'}); start `gpuflow node --pool {pool}` on more "
                        "machines, or lower nodes")
    return ready[:count]


def start_node(params, job: NodeJob, flow_name: str):
    """The node's flow run on its machine's queue; returned at once (the parent watches it)."""
    from prefect.deployments import run_deployment

    # the parameters as given, so that paths resolve on the node (data/ and runs/ are the node's own);
    # the store is the parent's, which every node logs into
    values = dict(flow_run.get_parameters()) | {"tracking_uri": absolute_uri(params.tracking_uri),
                                                 "job": job.model_dump()}
    return run_deployment(f"{flow_name}/{params.node_pool}", parameters=values, timeout=0,
                          work_queue_name=job.name, idempotency_key=f"{job.id}-{job.index}",
                          flow_run_name=f"{job.name}-{job.id[:8]}")


def watch(children: dict, start_timeout_s: float) -> None:
    """Until every node has COMPLETED: their logs relayed with the node's name; a node that fails, or
    has not started within `start_timeout_s`, cancels the others and fails the run naming it."""
    from prefect.client.orchestration import get_client

    log, started, seen = get_run_logger(), time.monotonic(), set()
    with get_client(sync_client=True) as client:
        try:
            while True:
                runs = {m: client.read_flow_run(r.id) for m, r in children.items()}
                relay_logs(client, runs, seen, log)
                states = {m: r.state.type.value if r.state else "SCHEDULED" for m, r in runs.items()}
                if all(s in DONE for s in states.values()):
                    return
                if any(s in ENDED for s in states.values()):
                    break
                late = [m for m, s in states.items() if s in WAITING]
                if late and time.monotonic() - started > start_timeout_s:
                    raise NodeFailed(f"node {late[0]} did not start within {start_timeout_s:g} s: no worker took "
                                     f"its queue; run `gpuflow node` on that machine, or pick other nodes")
                time.sleep(POLL_S)
        except BaseException:
            cancel(client, children)
            raise
        polled = last_polls(client, runs)
        left_open = cancel(client, children)
        silent = [m for m in left_open if m in polled and last_polls(client, {m: runs[m]}).get(m) == polled[m]]
        raise NodeFailed(node_failure(runs, states, silent))


def last_polls(client, runs: dict) -> dict:
    """When each node's worker last polled its machine's queue (a node whose queue is gone: left out)."""
    from prefect.exceptions import ObjectNotFound

    polls = {}
    for m, r in runs.items():
        try:
            polls[m] = client.read_work_queue_by_name(r.work_queue_name, work_pool_name=r.work_pool_name).last_polled
        except ObjectNotFound:
            pass
    return polls


def node_failure(runs: dict, states: dict, silent: list[str]) -> str:
    """One line naming the node whose failure the others followed: one whose machine went silent (its
    run left open, its worker no longer polling), else the first to end; then the others' states."""
    if silent:
        m = silent[0]
        why = ("its machine stopped answering: its run never ended, its worker stopped polling and nobody "
               "answered the cancellation (the machine, or its `gpuflow node`, is gone)")
    else:
        m = min((o for o, s in states.items() if s in ENDED), key=lambda o: runs[o].state.timestamp)
        why = (runs[m].state.message or states[m]).splitlines()[0]
    others = ", ".join(f"{o} {s.lower()}" for o, s in states.items() if o != m)
    return f"node {m} failed: {why} (other nodes: {others})"


def relay_logs(client, runs: dict, seen: set, log) -> None:
    """Each node's new log lines, in order, in the parent's log with the node's name in front."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    by_id = {r.id: m for m, r in runs.items()}
    while True:
        page = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=list(by_id))), offset=len(seen),
                                limit=200, sort=LogSort.TIMESTAMP_ASC)
        for line in page:
            if line.id not in seen:
                seen.add(line.id)
                log.info("[%s] %s", by_id.get(line.flow_run_id, "?"), line.message)
        if len(page) < 200:
            return


def cancel(client, runs: dict) -> list[str]:
    """Cancel every node not yet ended: its worker stops the processes. A node whose machine is gone
    has no worker left to do so: after the grace its run is marked Cancelled, so none stays open.
    Returns those nodes."""
    from prefect.states import Cancelled, Cancelling

    def open_runs():
        return [m for m, r in runs.items() if not (client.read_flow_run(r.id).state or Cancelling()).is_final()]

    for m in open_runs():
        client.set_flow_run_state(runs[m].id, Cancelling(message="another node of the run failed"), force=True)
    deadline = time.monotonic() + CANCEL_GRACE_S
    while (left := open_runs()) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    for m in left:
        client.set_flow_run_state(runs[m].id, Cancelled(message="its machine did not answer the cancellation"),
                                  force=True)
    return left


# --- the nodes ----------------------------------------------------------------------------


@flow(name="train-node", flow_run_name=node_name, validate_parameters=False)
@in_node_folder
@flat_parameters(NodeParams)
def train_node(params: NodeParams) -> dict:
    """One machine's part of a placed run (started by the parent flow, never by hand)."""
    return run_job(Worker(params), Placement(node=params.job))


class ScriptNodeParams(ScriptParams):
    """A node's part of a placed script run: the run's parameters, and the job."""

    job: NodeJob


@flow(name="script-node", flow_run_name=node_name, validate_parameters=False)
@in_node_folder
@flat_parameters(ScriptNodeParams)
def script_node(params: ScriptNodeParams) -> dict:
    """One machine's part of a placed script run (started by the parent flow, never by hand): the
    node whose processes hold global rank 0 logs the script's files and registers its model; the
    others log their logs under nodes/<node>/."""
    return run_job(Script(params), Placement(node=params.job))
