"""One run on several machines, placed through a Prefect work pool.

    gpuflow node --pool gpuflow-nodes          # on each machine: its queue, and a worker on it
    gpuflow run --nodes 2 --gpus 4 ...         # anywhere: one run on two of those machines

Each machine serves one queue of the pool (named after it, concurrency 1) with a Prefect
process worker. The parent flow (train-pipeline with nodes > 1) opens the MLflow run, picks
machines whose queue a worker polls, and starts one `train-node` flow run on each queue.
A node is one more launcher of the training session: it probes and assigns its own cards and
holds their locks as a single-machine run does, prepares its data, and starts torchrun with
c10d's rendezvous. Node 0 hosts the rendezvous store: it picks a free port on its address and
publishes the endpoint as a Prefect Variable, which the other nodes read; nobody types it.
The node whose workers hold global rank 0 (torchrun decides) relays the metrics to the run,
logs the results and registers the model, and publishes its result for the parent.

A node that fails, or never starts (no worker polls its queue), fails the run with the node
named; the parent cancels the others, and a node whose peers are gone stops within a second
(c10d). Nothing keeps training alone. Restarts are off across machines: run it again.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.parse
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel, Field

from gpuflow.tasks.launch import Rendezvous, TrainingFailed, launch_training
from gpuflow.tasks.tracking import results, tracked
from gpuflow.tasks.tracking.store import absolute_uri
from gpuflow.training.contract import NODE_ADDR_ENV, NODE_DIR_ENV, RunFolder
from gpuflow.training.errors import UserError

from .params import PipelineParams, flat_parameters, worker_config
from .prepared import prepared
from .session import current_name, plan_tags, run_tags, training_session

POLL_S = 1.0
CANCEL_GRACE_S = 10.0  # a node's machine answers a cancellation within it, or is taken for gone
DONE = {"COMPLETED"}
ENDED = {"FAILED", "CRASHED", "CANCELLED", "CANCELLING"}
WAITING = {"SCHEDULED", "PENDING", "LATE", "AWAITINGRETRY", "PAUSED"}


class NodeJob(BaseModel):
    """What the parent tells each node: the job, which node it is, and the run it logs into."""

    # names that become folders, Variable names and store queries: their own alphabets, never a path
    id: str = Field(pattern=r"^[A-Za-z0-9-]{1,64}$",
                    description="the job's id (the parent flow run's): rendezvous id and Variable names")
    index: int = Field(ge=0, le=4096, description="0 hosts the rendezvous store and publishes its endpoint")
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$",
                      description="the machine's queue in the node pool; names the node in logs and artifacts")
    run_id: str = Field(pattern=r"^[0-9a-f]{32}$", description="the parent's MLflow run, which every node attaches to")


class NodeParams(PipelineParams):
    """A node's part of a placed run: the run's parameters, and the job."""

    job: NodeJob


class NodeFailed(TrainingFailed):
    """A node of a placed run failed or never started."""


def variable(kind: str, job_id: str) -> str:
    return f"gpuflow-{kind}-{job_id}"


# --- the parent ----------------------------------------------------------------------------


def place(params, stem: str, tags: dict, flow_name: str) -> dict:
    """The parent's part of a run with nodes > 1: machines picked, one MLflow run, the nodes
    started and watched until every one has ended."""
    from prefect.variables import Variable

    log = get_run_logger()
    machines = ready_queues(params.node_pool, params.nodes)
    job = flow_run.get_id() or os.urandom(8).hex()
    name = current_name(params.run_name, stem)
    tags = {**run_tags(), **tags, "nodes": params.nodes, "machines": ",".join(machines)}
    try:
        with tracked.tracked_run(params.tracking_uri, params.experiment, name, tags, None, params.runs_dir) as run:
            log.info("placing %d nodes of run %s on %s (max_restarts and launch_retries apply on one machine: "
                     "a node lost fails the run)", params.nodes, name, ", ".join(machines))
            if params.tracking_uri.startswith("sqlite:"):
                log.warning("every node logs into %s: each machine must reach that file (a shared filesystem); "
                            "the team stack's tracking server needs none (gpuflow stack)", params.tracking_uri)
            children = {m: start_node(params, NodeJob(id=str(job), index=i, name=m, run_id=run.run_id), flow_name)
                        for i, m in enumerate(machines)}
            watch(children, params.rdzv_timeout_s)
            result = Variable.get(variable("result", str(job)))
            if result is None:
                raise TrainingFailed("every node finished but none reported global rank 0's result")
            result = json.loads(result)
    finally:
        for kind in ("rdzv", "result"):
            Variable.unset(variable(kind, str(job)))
    return {"run_id": run.run_id, "status": "FINISHED", **result}


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


# --- a node --------------------------------------------------------------------------------


def node_address() -> str:
    """This machine's address for the other nodes: GPUFLOW_NODE_ADDR, else the one it reaches the
    Prefect API from (the network the nodes share with the orchestration)."""
    from prefect.settings import PREFECT_API_URL

    if os.environ.get(NODE_ADDR_ENV):
        return os.environ[NODE_ADDR_ENV]
    host = urllib.parse.urlparse(PREFECT_API_URL.value() or "http://127.0.0.1").hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent: this only picks the route's source address
        return s.getsockname()[0]


def rendezvous(job: NodeJob, nodes: int, timeout_s: float) -> Rendezvous:
    """Node 0 picks a free port on its address and publishes the endpoint; the others read it."""
    from prefect.variables import Variable

    address, key = node_address(), variable("rdzv", job.id)
    if job.index == 0:
        with socket.socket() as s:
            s.bind((address, 0))
            endpoint = f"{address}:{s.getsockname()[1]}"
        Variable.set(key, endpoint, overwrite=True)
    else:
        deadline = time.monotonic() + timeout_s
        while (endpoint := Variable.get(key)) is None:
            if time.monotonic() > deadline:
                raise NodeFailed(f"node 0 published no rendezvous endpoint within {timeout_s:g} s")
            time.sleep(POLL_S)
    return Rendezvous(endpoint=endpoint, id=job.id, nnodes=nodes, host=job.index == 0, local_addr=address,
                      interface=interface_of(address))


def interface_of(address: str) -> str | None:
    """The network interface that holds `address` on this machine."""
    import psutil

    return next((name for name, addrs in psutil.net_if_addrs().items() if any(a.address == address for a in addrs)),
                None)


def attach(params, job: NodeJob, s) -> tracked.TrackedRun:
    """The parent's MLflow run, for this node to log into, with this node's environment and plan."""
    run = tracked.attached_run(params.tracking_uri, job.run_id, Path(params.runs_dir) / f"{job.run_id}-{job.name}")
    run.log_json(s.report.model_dump(mode="json"), "environment_report.json", f"environment/{job.name}")
    run.log_json(s.plan.model_dump(mode="json"), "device_plan.json", f"environment/{job.name}")
    if job.index == 0:  # node 0's devices stand for the run's (every node's are in its plan artifact)
        for k, v in plan_tags(s.plan, params.world_size(s.plan)).items():
            run.client.set_tag(run.run_id, k, str(v))
    return run


def publish(job: NodeJob, summary: dict) -> None:
    """Global rank 0's outcome, for the parent to return (a child's return value cannot reach it)."""
    from prefect.variables import Variable

    Variable.set(variable("result", job.id), json.dumps(summary, default=str), overwrite=True)


def node_name() -> str:
    p = flow_run.get_parameters()
    return f"{p.get('job', {}).get('name', 'node')}-{str(p.get('job', {}).get('id', ''))[:8]}"


def in_node_folder(fn):
    """Run the node's flow in the folder `gpuflow node` serves from (the worker would use a temporary
    one), before its parameters resolve their paths there."""
    def run(**values):
        os.chdir(os.environ.get(NODE_DIR_ENV, "."))
        return fn(**values)

    run.__signature__, run.__doc__, run.__name__ = fn.__signature__, fn.__doc__, fn.__name__
    run.__qualname__, run.__module__ = fn.__qualname__, fn.__module__
    return run


@flow(name="train-node", flow_run_name=node_name, validate_parameters=False)
@in_node_folder
@flat_parameters(NodeParams)
def train_node(params: NodeParams) -> dict:
    """One machine's part of a placed run (started by the parent flow, never by hand)."""
    job = params.job
    with training_session(params, params.batch_size, params.precision) as s:
        data = prepared(params, s)
        rdzv = rendezvous(job, params.nodes, params.rdzv_timeout_s)
        run = attach(params, job, s)
        folder = RunFolder(run.workdir)
        config = worker_config(params, s.plan, data, folder)
        if job.index == 0:
            run.log_params(params.run_params(config, s.plan))
        with s.timer("launch"), run.relaying_metrics():
            result = launch_training.with_options(retries=0)(config.to_json(folder.config), s.plan, params, params,
                                                             folder.root, run.metrics_file, s.cards, rdzv)
        if not result.get("final_metrics"):
            return {"node": job.name, "rank0": False}
        version = results.log_results(run, result, params.registered_model, str(Path.cwd()),
                                      f"{params.model} trained on {params.dataset} over {params.nodes} nodes "
                                      f"(run {job.run_id})")
        publish(job, {**result, "model_version": version, "timings": s.timer.seconds})
    return {"node": job.name, "rank0": True, "model_version": version}
