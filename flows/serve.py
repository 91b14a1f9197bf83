"""Deployments, declared apart from the flow code and served by one process (`gpuflow serve`); `gpuflow node` serves
the node flows on a machine's queue. Runs on one host share a global concurrency limit: they never train at once.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import stat
import sys
import threading
from contextlib import suppress
from pathlib import Path

from prefect import serve
from prefect.deployments.runner import EntrypointType
from prefect.schedules import Cron

from gpuflow.tasks.devices.slot import DEVICE_LIMIT, limit_exists
from gpuflow.training.contract import NODE_DIR_ENV
from gpuflow.training.errors import UserError

from .allow import handed_on, operator_policy
from .nodeauth import NODE_QUEUE_ENV, make_node_key
from .infer import evaluate_model
from .nodes import script_node, train_node
from .retrain import retrain
from .script import train_script
from .settings import NodeService, Settings
from .sweep import sweep
from .train import train_pipeline


def deployments(settings: Settings | None = None) -> list:
    settings = settings or Settings()
    nightly = nightly_schedule(settings.retrain_cron, settings.timezone)
    # Module entrypoints (flows.train.train_pipeline): the flows use package-relative imports.
    common = dict(tags=["gpuflow"], entrypoint_type=EntrypointType.MODULE_PATH)
    return [
        train_pipeline.to_deployment(name="ddp", parameters={"strategy": "ddp"}, **common,
                                     description="One process per device (DDP; gloo on CPU)."),
        train_pipeline.to_deployment(name="dp", parameters={"strategy": "dp"}, **common,
                                     description="nn.DataParallel over the chosen GPUs (needs GPUs)."),
        retrain.to_deployment(name="nightly", schedules=[nightly], **common,
                              description="Train a challenger; move 'champion' only if better."),
        evaluate_model.to_deployment(name="evaluate", **common,
                                     description="Loss and metrics of a registered version on one device."),
        train_script.to_deployment(name="default", **common,
                                   description="Your own torchrun script (-p script=train.py -p script_args=[...])."),
        sweep.to_deployment(name="default", **common,
                            description="An Optuna search over a run's parameters (-p space=sweep.yaml -p trials=24)."),
    ]


def nightly_schedule(cron: str, tz: str) -> Cron:
    """The retrain/nightly schedule; UserError naming the setting when the cron or the time zone is not one."""
    from zoneinfo import ZoneInfo

    try:
        ZoneInfo(tz)
        return Cron(cron, timezone=tz)
    except (ValueError, KeyError) as e:  # KeyError: ZoneInfoNotFoundError
        raise UserError(f"retrain_cron={cron!r}, timezone={tz!r}: {e.args[0] if e.args else e}; give a five-field cron "
                        "(e.g. '0 2 * * *') and an IANA time zone (e.g. Europe/Paris) with --retrain-cron and "
                        "--timezone, or GPUFLOW_RETRAIN_CRON and GPUFLOW_TIMEZONE") from None


def ensure_device_limit() -> str:
    """Create (or keep) this host's global concurrency limit for device-holding runs: one at a time."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    name = DEVICE_LIMIT.format(host=socket.gethostname())
    if not limit_exists(name):
        with get_client(sync_client=True) as client:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
    return name


def interrupt_on_ctrl_c() -> None:
    """Ctrl-C raises KeyboardInterrupt wherever the serving loop is, and serve() shuts down, its output piped to a
    reader the same Ctrl-C stopped (`gpuflow serve | tee log`) included."""

    # asyncio.run swaps Python's default handler for one that only cancels its main task (serve did not return)
    def handler(signum, frame):
        output_that_cannot_break()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)


def _relay(source: int, target: int) -> None:
    """Copy `source` to `target` until its end; once `target` refuses (its reader gone), drop the rest."""
    with open(source, "rb", buffering=0) as relayed:
        while chunk := relayed.read(65536):
            view = memoryview(chunk)
            while target >= 0 and view:
                try:
                    view = view[os.write(target, view):]
                except OSError:  # EPIPE: nobody reads it any more
                    target = -1


def output_that_cannot_break() -> None:
    """stdout and stderr, where they are pipes, written through a thread (`_relay`) from now on: rich, which prints
    Prefect's log lines, turns a write to a pipe whose reader is gone into SystemExit(1), which ends serve halfway
    through its shutdown or, raised in one of its tasks, leaves it serving; no library relays a pipe."""
    if getattr(output_that_cannot_break, "done", False):
        return
    output_that_cannot_break.done = True  # type: ignore[attr-defined]
    pipes: dict[tuple[int, int], list[int]] = {}
    for fd in (1, 2):
        with suppress(OSError):
            st = os.fstat(fd)
            if stat.S_ISFIFO(st.st_mode):
                pipes.setdefault((st.st_dev, st.st_ino), []).append(fd)  # `2>&1`: one pipe, one relay
    relays = []
    for fds in pipes.values():
        target, (source, sink) = os.dup(fds[0]), os.pipe()
        for fd in fds:
            os.dup2(sink, fd)
        os.close(sink)
        relays.append(threading.Thread(target=_relay, args=(source, target), daemon=True, name="gpuflow-output"))
        relays[-1].start()
    if relays:
        atexit.register(_drain, relays)


def _drain(relays: list[threading.Thread]) -> None:
    """At exit: what serve wrote last reaches the reader, if it is still there."""
    for stream in (sys.stdout, sys.stderr):
        with suppress(Exception):
            stream.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):  # the relays' last writers: their end of file
        os.dup2(devnull, fd)
    for relay in relays:
        relay.join(DRAIN_S)


DRAIN_S = 5


def api_refusal(url: str, e: BaseException | None = None) -> UserError:
    """No Prefect server (more) at `url`, in one line naming it and what to start."""
    why = f"stopped answering ({type(e).__name__}: {e})" if e else "does not answer"
    return UserError(f"the Prefect server at {url} {why}: start it with `gpuflow server` (or `make server`) in "
                     "another terminal, or set PREFECT_API_URL to the server to serve, then `gpuflow serve` again")


def main(settings: Settings | None = None) -> None:
    """Serve the deployments against PREFECT_API_URL, else the `gpuflow server` of the settings."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from gpuflow.tasks.tracking.tracked import api_lost

    from .api import http_status

    settings = settings or Settings()
    served = deployments(settings)  # a bad schedule refused before any server is asked
    url = PREFECT_API_URL.value() or settings.prefect_api_url
    if http_status(f"{url}/health") is None:
        raise api_refusal(url)
    # the runs this process starts, and their children, apply it
    with handed_on(operator_policy(settings)), temporary_settings(updates={PREFECT_API_URL: url}):
        try:
            ensure_device_limit()
            interrupt_on_ctrl_c()
            # a deployment run starts within 2 s of being asked for, not Prefect's 10
            serve(*served, query_seconds=float(os.environ.get("PREFECT_RUNNER_POLL_FREQUENCY", 2)))
        except Exception as e:
            if api_lost(e):
                raise api_refusal(url, e) from None
            raise


if __name__ == "__main__":
    main()


# --- a machine of the pool -----------------------------------------------------------------


def serve_node(service: NodeService) -> int:
    """The pool, this machine's queue (one job at a time) and the node deployments made if missing, then a Prefect
    worker on the queue in the foreground, in this folder: placed runs resolve paths as a run started here would."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
    from prefect.settings import PREFECT_API_URL

    from gpuflow.training.reaper import run_supervised

    if not PREFECT_API_URL.value():
        raise UserError("a node serves the Prefect server the team shares: set PREFECT_API_URL to it "
                        "(e.g. http://10.0.0.5:4200/api), as on the machine that starts the runs")
    name = service.name or socket.gethostname().split(".")[0]
    with get_client(sync_client=True) as client:
        try:  # the pool's first machine makes the key; the others must have a copy of it
            client.read_deployment_by_name(f"{train_node.name}/{service.pool}")
            first = False
        except ObjectNotFound:
            first = True
    key, made = make_node_key(service.pool, first)  # before anything is served: without it no job is admitted
    if made:
        print(f"gpuflow node: made pool {service.pool}'s node key {key} (0600); copy it, 0600, to every other "
              "machine of the pool and every account that places runs (GPUFLOW_NODE_KEY names where it is)",
              file=sys.stderr)
    with get_client(sync_client=True) as client:
        # machines starting together race to make the pool and the deployment: either wins
        with suppress(ObjectAlreadyExists):
            client.create_work_pool(WorkPoolCreate(name=service.pool, type="process"))
        with suppress(ObjectAlreadyExists):  # no queue limit: a run held PENDING by an API caller holds no slot
            client.create_work_queue(name=name, work_pool_name=service.pool)
        queue = client.read_work_queue_by_name(name, work_pool_name=service.pool)
        if queue.concurrency_limit is not None:  # made by an older gpuflow node
            client.update_work_queue(queue.id, concurrency_limit=None)
        crash_leftovers(client, service.pool, name)
    for node_flow in (train_node, script_node):
        node_flow.to_deployment(name=service.pool, tags=["gpuflow"], entrypoint_type=EntrypointType.MODULE_PATH,
                                description="One machine's part of a placed run (gpuflow run --nodes N)."
                                ).apply(work_pool_name=service.pool)
    # the worker's flow runs inherit these, and only these: it ignores the job variables a caller sends
    os.environ.update({NODE_DIR_ENV: str(Path.cwd()), NODE_QUEUE_ENV: name})
    os.environ.setdefault("PREFECT_WORKER_QUERY_SECONDS", "1")  # a placed run starts within 1 s, not 10
    print(f"gpuflow node: machine {name} of pool {service.pool}, serving from {Path.cwd()}", file=sys.stderr)
    with handed_on(operator_policy(Settings())):  # placed runs are deployment runs: this machine's operator's door
        return run_supervised([sys.executable, "-m", "gpuflow.flows.nodeworker", service.pool, name,
                               str(Path.cwd())])


def crash_leftovers(client, pool: str, queue: str) -> None:
    """This queue's runs left open by a node process that was killed (its machine's worker serves them alone): marked
    Crashed at the node's next start, so that its parent and the UI see them ended."""
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType,
                                                WorkPoolFilter, WorkPoolFilterName, WorkQueueFilter,
                                                WorkQueueFilterName)
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    left = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
            any_=[StateType.PENDING, StateType.RUNNING, StateType.CANCELLING]))),
        work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])),
        work_queue_filter=WorkQueueFilter(name=WorkQueueFilterName(any_=[queue])))
    for run in left:
        client.set_flow_run_state(run.id, Crashed(message=f"machine {queue}'s gpuflow node was restarted while this "
                                                          "run was open: its process is gone"), force=True)
