"""A node's side of a placed run (flows/nodes.py): which node it is, and the rendezvous, whose endpoint node 0
publishes as a Prefect Variable for the others; torchrun's static rendezvous (node rank = the node's index) then
gives the global ranks.
"""

from __future__ import annotations

import os
import socket
import time
import urllib.parse

from prefect import get_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel, Field

from gpuflow.tasks.failure import would_repeat
from gpuflow.tasks.launch import Rendezvous, TrainingFailed
from gpuflow.training.contract import NODE_ADDR_ENV, NODE_DIR_ENV

POLL_S = 1.0
NO_ENDPOINT = "published no rendezvous endpoint"  # how a node that waited for node 0 in vain ends


class NodeJob(BaseModel):
    """What the parent tells each node: the job, which node it is, and the run it logs into."""

    # names that become folders, Variable names and store queries: their own alphabets, never a path
    id: str = Field(pattern=r"^[A-Za-z0-9-]{1,64}$",
                    description="the job's id (the parent flow run's): rendezvous id and Variable names")
    index: int = Field(ge=0, le=4096, description="0 hosts the rendezvous store and publishes its endpoint")
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$",
                      description="the machine's queue in the node pool; names the node in logs and artifacts")
    run_id: str = Field(pattern=r"^[0-9a-f]{32}$", description="the parent's MLflow run, which every node attaches to")
    round: int = Field(0, ge=0, le=100, description="how many machines were replaced before this node started")
    resume: str | None = Field(None, pattern=r"^checkpoints/epoch-[0-9]{4,8}\.pt$",
                               description="the run's checkpoint artifact every node resumes from (a replacement)")
    keep_all: bool = Field(False, description="keep and upload every epoch's checkpoint (replacements allowed)")
    nodes: int | None = Field(None, ge=1, le=1024, description="this round's machines when fewer than nodes (a "
                              "machine lost and no spare came, with min_nodes)")
    parent: str | None = Field(None, pattern=r"^[0-9a-f-]{36}$", description="the parent's Prefect flow run, "
                               "which must still run when the node starts")
    flow: str | None = Field(None, pattern=r"^(train|script)-node$", description="the node flow the job is for")
    expires: float = Field(0.0, description="unix time after which the node refuses the job (its parent gave up)")
    seal: str | None = Field(None, pattern=r"^[0-9a-f]{64}$", description="HMAC of the job and every parameter "
                             "with the pool's node key (flows/nodeauth.py)")

    @property
    def folder_name(self) -> str:
        """This node's folder in runs_dir, new for each round: a replacement never resumes from leftovers."""
        return f"{self.name}-r{self.round}" if self.round else self.name


WOULD_REPEAT = "WouldRepeat"  # a node's end state when a spare would fail the same way


class NodeFailed(TrainingFailed):
    """A node of a placed run failed or never started (`node`: the machine, when one is to blame;
    `repeats`: its job would fail the same way on any machine, so no spare is taken)."""

    def __init__(self, message: str, node: str | None = None, repeats: bool = False):
        super().__init__(message)
        self.node, self.repeats = node, repeats


def rdzv_variable(job_id: str) -> str:
    """The Prefect Variable in which node 0 publishes the rendezvous endpoint."""
    return f"gpuflow-rdzv-{job_id}"


def node_address() -> str:
    """This machine's address for the other nodes: GPUFLOW_NODE_ADDR, else the one it reaches the
    Prefect API from (the network the nodes share with the orchestration)."""
    from prefect.settings import PREFECT_API_URL

    if address := os.environ.get(NODE_ADDR_ENV):
        return address
    host = urllib.parse.urlparse(PREFECT_API_URL.value() or "http://127.0.0.1").hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent: this only picks the route's source address
        return s.getsockname()[0]


def rendezvous(job: NodeJob, nodes: int, timeout_s: float) -> Rendezvous:
    """Node 0 picks a free port on its address and publishes the endpoint, sealed with the node key for this round;
    the others join only an endpoint so sealed (any API user can write the Variable: a forgery is passed over)."""
    from prefect.variables import Variable

    from .nodeauth import read_key, seal_endpoint, sealed_endpoint

    address, name, key = node_address(), rdzv_variable(job.id), read_key()
    if job.index == 0:
        with socket.socket() as s:
            s.bind((address, 0))
            endpoint = f"{address}:{s.getsockname()[1]}"
        Variable.set(name, seal_endpoint(job.id, endpoint, key), overwrite=True)
    else:
        deadline, forged = time.monotonic() + timeout_s, None
        while (endpoint := sealed_endpoint(job.id, published := Variable.get(name), key)) is None:
            if published is not None and published != forged:
                forged = published
                get_run_logger().warning("passed over an endpoint in Variable %s that node 0 did not seal (written "
                                         "by another API user); waiting for node 0's", name)
            if time.monotonic() > deadline:
                raise NodeFailed(f"node 0 {NO_ENDPOINT} within {timeout_s:g} s")
            time.sleep(POLL_S)
    return Rendezvous(endpoint=endpoint, id=job.id, nnodes=nodes, rank=job.index, local_addr=address,
                      interface=interface_of(address))


def interface_of(address: str) -> str | None:
    """The network interface that holds `address` on this machine."""
    import psutil

    return next((name for name, addrs in psutil.net_if_addrs().items() if any(a.address == address for a in addrs)),
                None)


def node_name() -> str:
    job = flow_run.get_parameters().get("job", {})
    return f"{job.get('name', 'node')}-{str(job.get('id', ''))[:8]}"


def admit_node_run(values: dict) -> None:
    """A node runs only a job its parent sealed for this machine, while that parent runs, once (flows/nodeauth.py)."""
    from prefect.client.orchestration import get_client

    from .nodeauth import NODE_QUEUE_ENV, NodeRunRefused, check_job, key_path, record_job

    with get_client(sync_client=True) as client:
        this = client.read_flow_run(flow_run.get_id())
        # under another worker (a Kubernetes pool's): the queue the run came through, which the job must name
        job = check_job(values, os.environ.get(NODE_QUEUE_ENV) or this.work_queue_name, this, flow_run.get_flow_name())
        state = client.read_flow_run(job["parent"]).state if job.get("parent") else None
    if job.get("parent"):
        if state is None or not state.is_running():
            raise NodeRunRefused(f"refused node {job['index']} of job {job['id']!r}: its parent flow run "
                                 f"{job['parent']} is {state.type.value if state else 'not started'}, not RUNNING")
    record_job(job, key_path().parent)


def as_a_node(fn):
    """Run the node's flow in the folder `gpuflow node` serves from; a failure any machine would repeat ends its
    run in the state WOULD_REPEAT, which tells the parent to take no spare for it."""
    from prefect.states import Failed

    def run(**values):
        os.chdir(os.environ.get(NODE_DIR_ENV, "."))
        try:
            admit_node_run(values)
            return fn(**values)
        except Exception as e:  # noqa: BLE001 - only what would repeat is told apart
            if not would_repeat(e):
                raise
            return Failed(name=WOULD_REPEAT, message=f"{type(e).__name__}: {str(e).splitlines()[0]}")

    run.__signature__, run.__doc__, run.__name__ = fn.__signature__, fn.__doc__, fn.__name__
    run.__qualname__, run.__module__ = fn.__qualname__, fn.__module__
    return run
