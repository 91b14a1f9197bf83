"""Watching a placed run's nodes (flows/nodes.py): their states and logs, the one whose failure the
others followed, and cancelling every node still open."""

from __future__ import annotations

import time
from datetime import timedelta

from prefect import get_run_logger

from .rendezvous import NO_ENDPOINT, POLL_S, WOULD_REPEAT, NodeFailed

CANCEL_GRACE_S = 10.0  # a node's machine answers a cancellation within it, or is taken for gone
DONE = {"COMPLETED"}
ENDED = {"FAILED", "CRASHED", "CANCELLED", "CANCELLING"}
WAITING = {"SCHEDULED", "PENDING", "LATE", "AWAITINGRETRY", "PAUSED"}
# a peer gave up waiting (torchrun's static rendezvous: node 0's store, or a follower's connection to it): one still
# waiting to start is the cause (CI11)
RDZV_TIMEOUT = ("RendezvousTimeoutError", "waiting for clients", "DistStoreError")
# A node's lines reach the server in batches (Prefect's every 2 s) from two processes, its worker and its flow run, so
# one may land before lines already relayed: each read goes back this far behind the newest line relayed.
LATE_S = 30


def watch(children: dict, start_timeout_s: float) -> None:
    """Until every node has COMPLETED: their logs relayed with the node's name; a node that fails, or
    has not started within `start_timeout_s`, cancels the others and fails the run naming it."""
    from prefect.client.orchestration import get_client

    log, started, seen = get_run_logger(), time.monotonic(), {}
    with get_client(sync_client=True) as client:
        try:
            while True:
                runs = {m: client.read_flow_run(r.id) for m, r in children.items()}
                relay_logs(client, runs, seen, log)
                states = {m: r.state.type.value if r.state else "SCHEDULED" for m, r in runs.items()}
                if all(s in DONE for s in states.values()):
                    return
                late = [m for m, s in states.items() if s in WAITING]  # first: the others' rendezvous waits for it
                gave_up = any(gave_up_waiting(r.state.message) for r in runs.values() if r.state)
                if late and (time.monotonic() - started > start_timeout_s or gave_up):
                    raise NodeFailed(f"node {late[0]} did not start within {start_timeout_s:g} s: no worker took "
                                     f"its queue; run `gpuflow node` on that machine, or pick other nodes",
                                     node=late[0])
                if any(s in ENDED for s in states.values()):
                    break
                time.sleep(POLL_S)
        except BaseException:
            cancel(client, children)
            raise
        polled = last_polls(client, runs)
        left_open = cancel(client, children)
        silent = [m for m in left_open if m in polled and last_polls(client, {m: runs[m]}).get(m) == polled[m]]
        lost, why = node_failure(runs, states, silent)
        raise NodeFailed(why, node=lost, repeats=getattr(runs[lost].state, "name", None) == WOULD_REPEAT)


def gave_up_waiting(message: str | None) -> bool:
    return any(sign in (message or "") for sign in RDZV_TIMEOUT)


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


def node_failure(runs: dict, states: dict, silent: list[str]) -> tuple[str, str]:
    """One line naming the node whose failure the others followed: one whose machine went silent (its
    run left open, its worker no longer polling), else the first to end, unless it ended waiting for a node still
    open at the rendezvous (that node is named); then the others' states."""
    if silent:
        m = silent[0]
        why = ("its machine stopped answering: its run never ended, its worker stopped polling and nobody "
               "answered the cancellation (the machine, or its `gpuflow node`, is gone)")
    else:
        m = min((o for o, s in states.items() if s in ENDED), key=lambda o: runs[o].state.timestamp)
        why = (runs[m].state.message or states[m]).splitlines()[0]
        waited_for = [o for o, s in states.items() if s not in ENDED | DONE]  # node 0 first
        said = runs[m].state.message or ""
        if waited_for and (NO_ENDPOINT in said or gave_up_waiting(said) and len(waited_for) == 1):
            m, why = waited_for[0], f"it never joined the rendezvous: node {m} gave up waiting for it ({why})"
    others = ", ".join(f"{o} {s.lower()}" for o, s in states.items() if o != m)
    return m, f"node {m} failed: {why} (other nodes: {others})"


def relay_logs(client, runs: dict, seen: dict, log) -> None:
    """Each node's new log lines, in the parent's log with the node's name in front; `seen`: the lines relayed
    (id: timestamp, only those of the last LATE_S s: the lines each read goes back to). A line that lands late,
    behind lines already relayed, is relayed when it lands."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterTimestamp
    from prefect.client.schemas.sorting import LogSort

    by_id = {r.id: m for m, r in runs.items()}
    since = None
    if seen:
        since = LogFilterTimestamp(after_=max(seen.values()) - timedelta(seconds=LATE_S))
        for old in [i for i, at in seen.items() if at < since.after_]:
            del seen[old]
    offset = 0
    while True:
        page = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=list(by_id)), timestamp=since),
                                offset=offset, limit=200, sort=LogSort.TIMESTAMP_ASC)
        for line in page:
            if line.id not in seen:
                seen[line.id] = line.timestamp
                log.info("[%s] %s", by_id.get(line.flow_run_id, "?"), line.message)
        if len(page) < 200:
            return
        offset += len(page)


def cancel(client, runs: dict) -> list[str]:
    """Cancel every node not yet ended; those whose machine did not answer within the grace are marked Cancelled
    and returned."""
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
