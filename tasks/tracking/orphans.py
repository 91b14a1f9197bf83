"""Runs left RUNNING by an owner that died (SIGKILL, the OOM killer, a host crash), marked KILLED at once by the
run's watcher (watcher.py) or, where that died too (a host crash), by the next run on that host. Each run records
its owner's host, pid and start time, so a reused pid does not count as alive.
"""

from __future__ import annotations

import os
import socket

from mlflow.tracking import MlflowClient

from .store import FLOW_RUN_TAG, default_tracking_uri, end_run, open_store

OWNER_HOST, OWNER_PID, OWNER_STARTED = "gpuflow.owner.host", "gpuflow.owner.pid", "gpuflow.owner.started"


def owner_tags() -> dict[str, str]:
    """This process as a run's owner: host, pid and start time."""
    import psutil

    return {OWNER_HOST: socket.gethostname(), OWNER_PID: str(os.getpid()),
            OWNER_STARTED: f"{psutil.Process().create_time():.3f}"}


def owner_alive(tags: dict[str, str]) -> bool:
    import psutil

    try:
        proc = psutil.Process(int(tags[OWNER_PID]))
        return abs(proc.create_time() - float(tags[OWNER_STARTED])) < 0.01
    except (KeyError, ValueError, psutil.NoSuchProcess):
        return False


def running(client: MlflowClient, tag: str, value: str) -> list:
    """The RUNNING runs of every experiment with tag `tag` = `value`."""
    ids = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(ids, f"attributes.status = 'RUNNING' and tags.`{tag}` = '{value}'") if ids else []


def reap_orphaned_runs(client: MlflowClient) -> list[str]:
    """Mark KILLED every RUNNING run of this host whose owner process is gone; their ids."""
    host = socket.gethostname()
    reaped = []
    for run in running(client, OWNER_HOST, host):
        if not owner_alive(run.data.tags):
            end_orphaned_run(client, run, "the next gpuflow run on this host")
            reaped.append(run.info.run_id)
    return reaped


def end_orphaned_run(client: MlflowClient, run, by: str) -> None:
    """End `run`, whose owner died without ending it, KILLED; its `error` tag names the owner and `by`."""
    tags = run.data.tags
    end_run(client, run.info.run_id, "KILLED",
            f"its owner (pid {tags.get(OWNER_PID)} on {tags.get(OWNER_HOST)}) ended without ending the "
            f"run (killed or crashed); marked KILLED by {by}")


def hooked_store(given) -> str:
    """The store a hook may open for a flow run's `tracking_uri`, as sent: under a served policy only one it allows,
    else the operator's own, never an address a caller named to collect the credentials."""
    from gpuflow.training.policy import NotAllowed, Policy

    policy = Policy.from_env()
    if policy is None:
        return given if isinstance(given, str) and given else default_tracking_uri()
    try:
        policy.check_store("tracking_uri", given)
        return given
    except NotAllowed:
        return policy.home_store


def end_flow_run_mlflow_runs(flow, flow_run, state) -> None:
    """Prefect state hook (on_crashed, on_cancellation): end the flow run's MLflow run KILLED.

    Prefect's runner calls it in its own process, where the flow's `finally` never ran."""
    uri = hooked_store((flow_run.parameters or {}).get("tracking_uri"))
    client = open_store(uri)  # under the lock: a run starting beside it may be creating the file
    for run in running(client, FLOW_RUN_TAG, str(flow_run.id)):
        end_run(client, run.info.run_id, "KILLED",
                f"Prefect flow run {flow_run.name} ended {state.name}: {state.message or 'no message'}")
