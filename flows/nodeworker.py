"""`gpuflow node`'s worker: a Prefect process worker that runs only gpuflow's node flows, as its operator set them up.

Prefect's process worker takes the command, environment and working folder of a flow run from the work pool's job
template and the job variables that anyone holding the API's credential may set (a deployment's, a flow run's), and
loads the flow's code from the deployment (its entrypoint, its pull steps), which that caller may change too. This
worker ignores all of that: its flow-run processes run `python -m prefect.engine` on the node flow of the run's
deployment, named here, in the node's folder, with the environment `gpuflow node` was started with. A flow run that
is not a node job sealed for this machine (flows/nodeauth.py) is refused before any process starts.
"""

from __future__ import annotations

import asyncio
import sys
from uuid import UUID

from prefect.utilities.processutils import command_to_string
from prefect.workers.process import ProcessJobConfiguration, ProcessWorker

from .nodeauth import NodeRunRefused, check_job

FLOW_ENTRYPOINT_ENV = "PREFECT__FLOW_ENTRYPOINT"  # Prefect's engine loads the flow from here, not from the deployment


class NodeWorker(ProcessWorker):
    """A process worker for one machine's queue; `flows`: the node deployments' ids and their flows' entrypoints."""

    def __init__(self, *, folder: str, queue: str, flows: dict[UUID, str], **kwargs):
        super().__init__(work_queues=[queue], **kwargs)
        self.folder, self.queue, self.flows = folder, queue, flows

    @classmethod
    def __dispatch_key__(cls) -> str:
        return "gpuflow-node"  # a type of its own in Prefect's registry: `process` stays Prefect's worker

    async def run(self, flow_run, configuration, task_status=None):
        """The flow run as its operator set the node up, whatever the pool's template and job variables say."""
        entrypoint = self.node_flow_of(flow_run)  # the node's door says that job variables sent were ignored
        fixed = await ProcessJobConfiguration.from_template_and_values(
            ProcessWorker.get_default_base_job_template(),
            {"command": command_to_string([sys.executable, "-m", "prefect.engine"]), "working_dir": self.folder},
            client=self.client)
        fixed.prepare_for_flow_run(flow_run, work_pool=self.work_pool, worker_name=self.name,
                                   worker_id=self.backend_id)
        fixed.env[FLOW_ENTRYPOINT_ENV] = entrypoint
        return await super().run(flow_run, fixed, task_status)

    def node_flow_of(self, flow_run) -> str:
        """The entrypoint of the run's node flow, or NodeRunRefused (the run is then reported crashed, its slot
        free at once): a run of no node deployment of this pool, or whose job is not sealed for this machine."""
        entrypoint = self.flows.get(flow_run.deployment_id)
        if entrypoint is None:
            raise NodeRunRefused(f"refused flow run {flow_run.name!r}: it is not a run of this pool's node "
                                 "deployments (train-node, script-node), the only flows a gpuflow node runs")
        check_job(flow_run.parameters, self.queue)
        return entrypoint


async def serve(pool: str, queue: str, folder: str, limit: int = 1) -> None:
    """Run the worker until stopped, for the node deployments that exist now."""
    from prefect.client.orchestration import get_client

    from .nodes import script_node, train_node

    flows = {}
    async with get_client() as client:
        for node_flow, attr in ((train_node, "train_node"), (script_node, "script_node")):
            deployment = await client.read_deployment_by_name(f"{node_flow.name}/{pool}")
            flows[deployment.id] = f"gpuflow.flows.nodes:{attr}"
    worker = NodeWorker(work_pool_name=pool, queue=queue, folder=folder, flows=flows, limit=limit, name=queue)
    await worker.start(printer=lambda *a, **k: print(*a, file=sys.stderr, flush=True))


if __name__ == "__main__":
    asyncio.run(serve(*sys.argv[1:4]))
