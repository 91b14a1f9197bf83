"""The training session that flows/job.py enters for every job, with parameters admitted at the job's door
(flows/calls.py `admit`): the host's device slot, the devices probed and assigned, their cards locked; and the
run's names and tags. `on_one_device` is the same for an evaluation or a prediction.
"""

from __future__ import annotations

import functools
import sys
import time
import uuid
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from prefect import get_run_logger
from prefect.runtime import deployment, flow_run

from gpuflow.tasks.tracking import store
from gpuflow.tasks.devices.assign import DevicePlan, assign_devices, one_device_plan
from gpuflow.tasks.devices.cards import card_locks
from gpuflow.tasks.devices.slot import device_slot
from gpuflow.tasks.devices.probe import EnvironmentReport, probe_environment

from .allow import deployment_id
from .params import Devices


class StepTimer:
    """Wall time per step, for a run's `pipeline/*_s` metrics and benchmarks."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, step: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[step] = round(time.perf_counter() - start, 3)


@dataclass
class Session:
    """The devices a run holds: the host's report, the plan, the card locks' descriptors (which
    the launcher's children hold too), and the time each step took."""

    report: EnvironmentReport
    plan: DevicePlan
    cards: tuple[int, ...]
    timer: StepTimer = field(default_factory=StepTimer)
    name: str = ""  # the run's, once flows/job.py has opened or joined it


@contextmanager
def training_session(params, slot: bool = True) -> Iterator[Session]:
    """For parameters admitted at the job's door (flows/calls.py `admit`): the host's device slot taken (unless
    `slot` is False: a sweep's trial, whose sweep holds it), devices probed and assigned, their cards locked."""
    with device_slot() if slot else nullcontext():  # served runs on one host queue here
        timer = StepTimer()
        with timer("probe"):
            report = probe_environment()
        with timer("assign"):
            plan = assign_devices(report, params, getattr(params, "batch_size", None),
                                  getattr(params, "precision", None))  # a script's params have neither
        for warning in [*report.warnings, *plan.warnings]:  # what the probe doubts; a card shared with another
            get_run_logger().warning("%s", warning)  # program trains slower, or runs out of memory
        with card_locks(plan) as locks:
            yield Session(report, plan, locks.fds, timer)


@contextmanager
def on_one_device(gpus: str, probe: Callable[[], EnvironmentReport] = probe_environment,
                  slot: bool = True) -> Iterator[tuple]:
    """One device as training takes one (the host's slot unless `slot` is False, the device `gpus` names, its
    card's lock), for an evaluation or a prediction; yields (plan, the locks' descriptors)."""
    with device_slot() if slot else nullcontext():
        plan = one_device_plan(probe(), Devices(gpus=gpus))
        with card_locks(plan) as locks:
            yield plan, locks.fds


# --- names and tags ----------------------------------------------------------------------


def unique_name(stem: str) -> str:
    """<stem>-<the flow run id's start> (a random one outside a flow run)."""
    return f"{stem}-{(flow_run.get_id() or uuid.uuid4().hex)[:6]}"


def current_name(given: str | None, stem: str) -> str:
    """The flow run's name, which the MLflow run takes (one name in both UIs); else `given`, else a unique one."""
    return flow_run.get_name() or given or unique_name(stem)


def entry_point() -> str:
    """What the user ran, for the MLflow run's source: the deployment (the one a retrain's training
    ran under is the retrain's), or the command."""
    if served_by := deployment_id():
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            served = client.read_deployment(served_by)
            return f"deployment {client.read_flow(served.flow_id).name}/{served.name}"
    prog = Path(sys.argv[0]).name
    return f"{prog} {sys.argv[1]}" if prog == "gpuflow" and len(sys.argv) > 1 else prog


def run_tags() -> dict:
    """The MLflow run's tags of the flow run that owns it: its Prefect run and source."""
    run = flow_run.get_id()
    return {store.FLOW_RUN_TAG: run, "prefect.flow_run_name": flow_run.get_name(),
            **(_source_of(run) if run else _source())}


def _source() -> dict:
    return {"prefect.deployment": deployment.get_name() if deployment_id() else None,
            "mlflow.source.git.commit": store.git_commit(), "mlflow.source.name": entry_point()}


@functools.lru_cache(maxsize=64)
def _source_of(run: str) -> dict:
    """A flow run's source, read once (API calls and a git process): a sweep's every trial asks for it."""
    return _source()


def plan_tags(plan: DevicePlan, world: int) -> dict:
    """The MLflow run's tags of the devices it trained on."""
    return {"strategy": plan.strategy, "world_size": world, "backend": plan.backend, "device": plan.device,
            "physical_gpus": ",".join(map(str, plan.physical_ids)) or "none",
            "primary_gpu": plan.primary if plan.primary is not None else "none"}
