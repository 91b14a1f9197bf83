"""One function runs every training job, whatever starts it: `run_job(launcher, placement)`. The launcher
(flows/launchers.py) says what trains; the Placement says where and in which MLflow run. The parents of jobs
(a placed run's, a sweep's) open their runs here too: `parent_run`.
"""

from __future__ import annotations

import threading
import uuid
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from prefect import get_run_logger

from gpuflow.tasks.tracking import results, tracked
from gpuflow.training.contract import RunFolder

from .calls import one_line
from .launchers import Launch, Outcome
from .rendezvous import NodeJob, rendezvous
from .session import Session, current_name, plan_tags, run_tags, training_session


@dataclass
class Placement:
    """Where a job runs and in which MLflow run. The default: this host (its device slot), a new
    run named as the flow run, the model registered and the run summarized."""

    slot: bool = True  # take the host's device slot (a sweep's trial: its sweep holds it)
    name: str | None = None  # the run's name (default: the flow run's)
    tags: dict = field(default_factory=dict)
    register: bool = True  # register the model (a sweep's trial: the sweep registers its best)
    node: NodeJob | None = None  # a node of a placed run: the parent's run, joined through the rendezvous
    stop: threading.Event | None = None  # set: the launch stops (a sweep's pruner)
    on_metrics: Callable[[int, dict], None] | None = None  # each epoch's metrics, as they arrive
    metric: str | None = None  # the one on_metrics wants
    cwd: Callable[[tracked.TrackedRun], Path] | None = None  # a script's working folder, given the run
    on_run: Callable[[tracked.TrackedRun], None] | None = None  # told the run once it is open
    on_stopped: Callable[[tracked.TrackedRun], None] | None = None  # a stopped launch: raise, or mark it
    system_metrics: bool = True  # sample the host (a sweep's trial: its sweep's run does, once for all its trials)
    checkpoint_each_epoch: bool = True  # False: the worker checkpoints its last epoch alone (a sweep's trial)


def run_job(launcher, where: Placement | None = None) -> dict:
    """Train with `launcher` on the devices and in the run `where` says; rank 0's result, the run
    id, the registered version and the steps' timings (`rank0` False on another node; `stopped`)."""
    where = where or Placement()
    p = launcher.params
    with training_session(p, slot=where.slot) as s:
        dataset = launcher.prepare(s)
        rdzv = rendezvous(where.node, p.nodes, p.rdzv_timeout_s) if where.node else None
        with job_run(s, launcher, where, dataset) as run:
            if run is None:  # a machine started by hand as node_rank > 0: node 0 owns the run
                folder = RunFolder.of(p.runs_dir, f"node{p.node_rank}", uuid.uuid4().hex[:8])
                outcome = launcher.launch(s, None, folder, Launch())
                return {"node_rank": p.node_rank, "rank0": False, "result": outcome.result, "timings": s.timer.seconds}
            if where.on_run:
                where.on_run(run)
            first = where.node is None or (where.node.index == 0 and where.node.round == 0)  # a run's params once
            how = Launch(log_params=first, rdzv=rdzv, node=where.node and where.node.name, on_metrics=where.on_metrics,
                         metric=where.metric, stop=where.stop, cwd=where.cwd(run) if where.cwd else None,
                         upload_checkpoints=bool(where.node and where.node.keep_all),
                         checkpoint_each_epoch=where.checkpoint_each_epoch)
            if where.register and p.registered_model:
                results.warm_model_logging()  # MLflow's one-time costs of registering, paid while the job trains
            outcome: Outcome = launcher.launch(s, run, RunFolder(run.workdir), how)
            if outcome.stopped:
                if where.on_stopped:
                    where.on_stopped(run)
                return {"run_id": run.run_id, "stopped": True}
            if not outcome.rank0:
                return {"run_id": run.run_id, "rank0": False, "node": how.node}
            version = launcher.finish(s, run, outcome, p.registered_model if where.register else None,
                                      summary=where.node is None and where.register)
            done = {"run_id": run.run_id, "status": "FINISHED", "model_version": version, **outcome.result,
                    "timings": s.timer.seconds}
            if where.node:  # the parent reads it from the run they share (flows/nodes.py place)
                run.log_json(done, PLACED_RESULT.name, PLACED_RESULT.parent.name)
    return done


PLACED_RESULT = Path("placement/result.json")  # a placed run's outcome, in its MLflow run


@contextmanager
def job_run(s: Session, launcher, where: Placement, dataset: dict | None) -> Iterator[tracked.TrackedRun | None]:
    """The job's MLflow run: a new one, ended FINISHED, FAILED or KILLED whatever happens; on a placed run's node
    the parent's (which the parent ends); None on a node started by hand."""
    p = launcher.params
    if where.node:
        yield attach(s, p, where.node)
        return
    if getattr(p, "node_rank", 0) != 0:
        yield None
        return
    s.name = name = where.name or current_name(p.run_name, launcher.stem)
    tags = {**run_tags(), **plan_tags(s.plan, p.world_size(s.plan)), **launcher.tags, **where.tags}
    with tracked.tracked_run(p.tracking_uri, p.experiment, name, tags, dataset, p.runs_dir,
                             system_metrics=where.system_metrics) as run:
        run.log_json(s.report.model_dump(mode="json"), "environment_report.json", "environment")
        run.log_json(s.plan.model_dump(mode="json"), "device_plan.json", "environment")
        try:
            yield run
        finally:  # a user's script may rename it with its own start_run
            try:
                run.client.set_tag(run.run_id, "mlflow.runName", name)
            except Exception as e:  # noqa: BLE001 - never in place of the job's own error
                get_run_logger().warning("the run's name %r was not set again: %s", name, one_line(e))


def attach(s: Session, p, job: NodeJob) -> tracked.TrackedRun:
    """The parent's MLflow run, for this node to log into, with this node's environment and plan."""
    run = tracked.attached_run(p.tracking_uri, job.run_id, RunFolder.of(p.runs_dir, job.run_id, job.folder_name).root)
    s.name = run.client.get_run(job.run_id).info.run_name
    run.log_json(s.report.model_dump(mode="json"), "environment_report.json", f"environment/{job.name}")
    run.log_json(s.plan.model_dump(mode="json"), "device_plan.json", f"environment/{job.name}")
    if job.index == 0:  # node 0's devices stand for the run's (every node's are in its plan artifact)
        for k, v in plan_tags(s.plan, p.world_size(s.plan)).items():
            run.client.set_tag(run.run_id, k, str(v))
    return run


def parent_run(p, name: str, tags: dict, resume: str | None = None) -> AbstractContextManager[tracked.TrackedRun]:
    """The run of a job's parent (a placed run's, a sweep's): its nodes or trials log into or under it."""
    return tracked.tracked_run(p.tracking_uri, p.experiment, name, {**run_tags(), **tags}, None, p.runs_dir,
                               resume=resume)
