"""`gpuflow node`'s worker: a Prefect process worker that runs only gpuflow's node flows, as its operator set them up.

Prefect's process worker takes the command, environment and working folder of a flow run from the work pool's job
template and the job variables that anyone holding the API's credential may set (a deployment's, a flow run's), and
loads the flow's code from the deployment (its entrypoint, its pull steps), which that caller may change too. This
worker ignores all of that: its flow-run processes run `python -m prefect.engine` on the node flow of the run's
deployment, named here, in the node's folder, with the environment `gpuflow node` was started with; it starts them
itself and stops them on a cancellation, so no flow is ever loaded from a deployment in the worker (Prefect's
executor would, for a crash or cancellation hook). A flow run that
is not a node job sealed for this machine (flows/nodeauth.py) is refused before any process starts.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from contextlib import suppress
from uuid import UUID

import anyio
from prefect.utilities.processutils import run_process
from prefect.workers.process import ProcessJobConfiguration, ProcessWorker, ProcessWorkerResult

from .nodeauth import NodeRunRefused, check_job

FLOW_ENTRYPOINT_ENV = "PREFECT__FLOW_ENTRYPOINT"  # Prefect's engine loads the flow from here, not from the deployment
CANCEL_POLL_S = 1.0  # how often a running node's state is read for a cancellation
STOP_GRACE_S = 30.0  # SIGTERM to SIGKILL: a node stops its ranks within gpuflow's own grace


class NodeWorker(ProcessWorker):
    """A process worker for one machine's queue; `flows`: the node deployments' ids, their flows' names and
    entrypoints."""

    def __init__(self, *, folder: str, queue: str, flows: dict[UUID, tuple[str, str]], **kwargs):
        super().__init__(work_queues=[queue], **kwargs)
        self.folder, self.queue, self.flows = folder, queue, flows

    @classmethod
    def __dispatch_key__(cls) -> str:
        return "gpuflow-node"  # a type of its own in Prefect's registry: `process` stays Prefect's worker

    async def run(self, flow_run, configuration, task_status=None):
        """The flow run as its operator set the node up, whatever the pool's template and job variables say: its
        process started here, not by Prefect's flow-run executor, whose crash and cancellation hooks load the flow
        from the deployment (running its pull steps, which any API caller may change) in this worker."""
        entrypoint = self.node_flow_of(flow_run)  # the node's door says that job variables sent were ignored
        fixed = await ProcessJobConfiguration.from_template_and_values(
            ProcessWorker.get_default_base_job_template(), {"working_dir": self.folder}, client=self.client)
        fixed.prepare_for_flow_run(flow_run, work_pool=self.work_pool, worker_name=self.name,
                                   worker_id=self.backend_id)
        env = {k: v for k, v in {**fixed.env, FLOW_ENTRYPOINT_ENV: entrypoint}.items() if v is not None}
        stopping = anyio.Event()  # set once a cancellation is being carried out: it then ends the run itself
        async with anyio.create_task_group() as group:
            def started(process) -> int:
                group.start_soon(self.stop_when_cancelled, flow_run, process, stopping)
                return process.pid

            process = await run_process([sys.executable, "-m", "prefect.engine"], stream_output=True, env=env,
                                        cwd=self.folder, task_status=task_status or anyio.TASK_STATUS_IGNORED,
                                        task_status_handler=started)
            if not stopping.is_set():
                group.cancel_scope.cancel()
        return ProcessWorkerResult(status_code=process.returncode, identifier=str(process.pid))

    async def stop_when_cancelled(self, flow_run, process, stopping: anyio.Event) -> None:
        """Once the run is CANCELLING (its parent, the UI): SIGTERM to its process (gpuflow stops what it started),
        SIGKILL after STOP_GRACE_S, then the run is marked Cancelled."""
        from prefect.states import Cancelled

        while not await self.cancelling(flow_run):
            await anyio.sleep(CANCEL_POLL_S)
        stopping.set()
        with suppress(ProcessLookupError):  # it ended meanwhile
            process.send_signal(signal.SIGTERM)
        with anyio.move_on_after(STOP_GRACE_S):
            await process.wait()
        if process.returncode is None:
            with suppress(ProcessLookupError):
                process.kill()
            await process.wait()
        await self.client.set_flow_run_state(flow_run.id, Cancelled(message="cancelled: its node process stopped"),
                                             force=True)

    async def cancelling(self, flow_run) -> bool:
        try:
            state = (await self.client.read_flow_run(flow_run.id)).state
        except Exception as e:  # noqa: BLE001 - the API out of reach for a moment: asked again at the next poll
            self._logger.debug("could not read flow run %s: %s", flow_run.id, e)
            return False
        return state is not None and state.is_cancelling()

    def node_flow_of(self, flow_run) -> str:
        """The entrypoint of the run's node flow, or NodeRunRefused (the run is then reported crashed, its slot
        free at once): a run of no node deployment of this pool, or whose job is not sealed for this machine."""
        flow, entrypoint = self.flows.get(flow_run.deployment_id, (None, None))
        if entrypoint is None:
            raise NodeRunRefused(f"refused flow run {flow_run.name!r}: it is not a run of this pool's node "
                                 "deployments (train-node, script-node), the only flows a gpuflow node runs")
        check_job(flow_run.parameters, self.queue, flow_run, flow)
        return entrypoint


async def serve(pool: str, queue: str, folder: str, limit: int = 1) -> None:
    """Run the worker until stopped, for the node deployments that exist now."""
    from prefect.client.orchestration import get_client

    from .nodes import script_node, train_node

    flows = {}
    async with get_client() as client:
        for node_flow, attr in ((train_node, "train_node"), (script_node, "script_node")):
            deployment = await client.read_deployment_by_name(f"{node_flow.name}/{pool}")
            flows[deployment.id] = (node_flow.name, f"gpuflow.flows.nodes:{attr}")
    worker = NodeWorker(work_pool_name=pool, queue=queue, folder=folder, flows=flows, limit=limit, name=queue)
    await worker.start(printer=lambda *a, **k: print(*a, file=sys.stderr, flush=True))


if __name__ == "__main__":
    asyncio.run(serve(*sys.argv[1:4]))
