"""Launch the worker as a child process: torchrun for DDP, plain python for single and DP.

The child starts with the DevicePlan's environment, so CUDA_VISIBLE_DEVICES takes effect before CUDA initialises.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Annotated

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import AfterValidator, BaseModel, Field, model_validator

from gpuflow.training.compat import FRESH_RDZV_STORE
from gpuflow.training.config import DistTimeout, Exists, absolute
from gpuflow.training.errors import UserError
from gpuflow.training.contract import (CARD_LOCKS_ENV, CARD_OWNER_ENV, DIST_TIMEOUT_ENV, LAUNCH_ATTEMPT_ENV,
                                       METRICS_FILE_ENV, OUTPUT_DIR_ENV, PROCESS_GROUP_FILE_ENV, RunFolder)

from .child import Stopped, run_child
from .failure import TrainingFailed, error_folder, failure
from .devices.assign import DevicePlan
from .devices.cards import rank_lock_files

class Launch(BaseModel):
    """The launch part of a flow's parameters (flows/params.py composes it with the others)."""

    max_restarts: int = Field(1, ge=0, le=100, description="torchrun elastic restarts after a worker dies")
    dist_timeout_s: DistTimeout = 300.0


def check_endpoint(v: str | None) -> str | None:
    host, _, port = (v or "").rpartition(":")
    if v is not None and not (host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError("not host:port; use node 0's address and a free port, e.g. 10.0.0.5:29500")
    return v


class Placement(BaseModel):
    """The machines of a job: one by default; several placed by the flow on the node pool's machines."""

    nodes: int = Field(1, ge=1, le=1024, description="machines to train on, placed by the flow through the "
                       "Prefect work pool node_pool (each machine runs `gpuflow node`); --gpus applies on each; "
                       "MIN:MAX (e.g. 1:2) sets min_nodes too", json_schema_extra={"cli": "range"})
    min_nodes: int | None = Field(None, ge=1, le=1024, description="placed runs with max_node_failures: the fewest "
                                  "machines the run goes on with when a lost one has no spare within rdzv_timeout_s "
                                  "(the batch split over fewer processes, the change logged); default: nodes")
    node_pool: str = Field("gpuflow-nodes", pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,99}$",
                           description="the Prefect work pool whose queues are the machines (nodes > 1)")
    rdzv_timeout_s: int = Field(300, ge=10, le=86_400, description="fail when not every node arrives (or, "
                                "placed, starts) in time")
    max_node_failures: int = Field(0, ge=0, le=100, description="placed runs (nodes > 1): machines that may "
                                   "be lost and replaced by a spare of the pool, the run resuming from its last "
                                   "checkpoint in the same MLflow run (a script: from its own, saved where every "
                                   "machine reads it); 0: a node lost fails the run")

    @model_validator(mode="before")
    @classmethod
    def _node_range(cls, values):
        """nodes="MIN:MAX" (the command line's --nodes 1:2) is min_nodes=MIN, nodes=MAX."""
        if isinstance(values, dict) and isinstance(values.get("nodes"), str) and ":" in values["nodes"]:
            low, _, high = values["nodes"].partition(":")
            if not (low.strip().isdigit() and high.strip().isdigit()):
                raise ValueError(f"nodes={values['nodes']!r} is not N or MIN:MAX; e.g. 2, or 1:2 (go on with one "
                                 "machine when a lost one has no spare)")
            values = {**values, "min_nodes": int(low), "nodes": int(high)}
        return values

    @model_validator(mode="after")
    def _replaceable(self) -> "Placement":
        if self.max_node_failures and self.nodes < 2:
            raise ValueError(f"max_node_failures={self.max_node_failures} replaces machines of a run placed on "
                             "several (nodes > 1); drop it, or set nodes")
        if self.min_nodes is not None and self.min_nodes > self.nodes:
            raise ValueError(f"min_nodes={self.min_nodes} is above nodes={self.nodes}; give MIN:MAX with MIN <= MAX")
        if self.min_nodes is not None and self.min_nodes < self.nodes and not self.max_node_failures:
            raise ValueError(f"nodes {self.min_nodes}:{self.nodes} goes on with fewer machines after losing one; "
                             "set max_node_failures (how many machines may be lost), e.g. --max-node-failures 1")
        return self


class Nodes(Placement):
    """Placement, and the low-level path: a job started by hand on each machine (nnodes, node_rank, rdzv_endpoint)."""

    nnodes: int = Field(1, ge=1, le=4096, description="low-level: machines of a job started by hand on each")
    node_rank: int = Field(0, ge=0, description="low-level: this machine's rank; only node 0 owns the MLflow run")
    rdzv_endpoint: Annotated[str | None, AfterValidator(check_endpoint)] = Field(
        None, description="low-level: host:port of node 0's rendezvous, the same on every machine")

    @model_validator(mode="after")
    def _joinable(self) -> "Nodes":
        if self.nodes > 1 and self.nnodes > 1:
            raise ValueError(f"nodes={self.nodes} places the run itself; drop nnodes={self.nnodes} (the "
                             "low-level path, for machines started by hand)")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(f"nnodes={self.nnodes} needs rdzv_endpoint=<node 0 host>:<port>, "
                             "the same on every node")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be below nnodes {self.nnodes}")
        return self


def check_script(v: str) -> str:
    path = Path(absolute(v))
    if path.suffix not in ("", ".py"):  # none: a folder, refused as one when the job is entered
        raise ValueError(f"{path.name} is not a Python file; torchrun runs a .py script")
    return str(path)


SCRIPT = Exists("no such file ({path}); give the path of your training script, e.g. train_ddp.py",
                folder="{path} is a directory; give the path of your training script in it, e.g. {path}/train.py")
ScriptFile = Annotated[str, AfterValidator(check_script), SCRIPT]
ScriptArgs = Annotated[list[str], Field(
    description="the script's own arguments (on the command line: everything after --); in a sweep, {name} "
    "in them is replaced by the trial's value of name, and a name without a placeholder is appended as "
    "--name=value", json_schema_extra={"cli": "rest"})]


class Rendezvous(BaseModel):
    """A placed job's c10d rendezvous: every node's agent joins the store node 0's agent hosts at `endpoint`."""

    endpoint: str
    id: str
    nnodes: int
    host: bool
    local_addr: str
    interface: str | None = None  # the one local_addr is on: gloo's and NCCL's sockets use it

    def environ(self) -> dict:
        """Collectives on the nodes' shared network, not the host name's address (often 127.0.0.1); a user's own
        GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME wins."""
        env = dict(FRESH_RDZV_STORE)
        if self.interface:
            env |= {k: os.environ.get(k, self.interface) for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
        return env


class RendezvousError(UserError):
    """The rendezvous endpoint is malformed or already taken on this host."""


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def build_command(plan: DevicePlan, launch: Launch, nodes: Nodes, config: Path, result: Path,
                  rdzv: Rendezvous | None = None) -> list[str]:
    worker = ["-m", "gpuflow.training", "--config", str(config), "--result", str(result)]
    if plan.strategy != "ddp":
        return [sys.executable, *worker]
    return [*torchrun(plan, launch, nodes, rdzv), *worker]


def torchrun(plan: DevicePlan, launch: Launch, opts: Nodes, rdzv: Rendezvous | None = None) -> list[str]:
    """torchrun with the plan's processes per node, restarts and rendezvous."""
    # no --tee/--log-dir for the worker: their log-tailing threads once kept a signalled torchrun from exiting
    restarts = 0 if rdzv else launch.max_restarts  # placed: a node that fails fails the job
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={plan.nproc_per_node}",
           f"--max-restarts={restarts}", "--role=rank"]
    if rdzv:  # its peers leave within a second; restarting them would resume from different checkpoints
        return [*cmd, f"--nnodes={rdzv.nnodes}:{rdzv.nnodes}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv.endpoint}", f"--rdzv-id={rdzv.id}",
                f"--local-addr={rdzv.local_addr}",  # the workers' MASTER_ADDR, when rank 0 is here
                f"--rdzv-conf=is_host={str(rdzv.host).lower()},join_timeout={opts.rdzv_timeout_s}"]
    if opts.nnodes == 1 and not opts.rdzv_endpoint:
        cmd += ["--standalone",  # c10d on a free localhost port: parallel runs never collide
                f"--rdzv-conf=join_timeout={opts.rdzv_timeout_s}"]
    else:
        # static rendezvous puts global rank 0 (MLflow, result.json) on node 0; c10d would rank in join order
        host, _, port = opts.rdzv_endpoint.rpartition(":")
        cmd += [f"--nnodes={opts.nnodes}", f"--node-rank={opts.node_rank}",
                f"--master-addr={host}", f"--master-port={port}",
                f"--rdzv-conf=timeout={opts.rdzv_timeout_s}"]
    return cmd


def check_rendezvous(opts: Nodes) -> None:
    """A rendezvous port already taken on this host fails now, with the port named."""
    if not opts.rdzv_endpoint or opts.node_rank != 0:
        return
    host, _, port = opts.rdzv_endpoint.rpartition(":")
    if not port.isdigit():
        raise RendezvousError(f"rdzv_endpoint {opts.rdzv_endpoint!r} must be host:port, e.g. 127.0.0.1:29400")
    if host in ("127.0.0.1", "localhost", "0.0.0.0", socket.gethostname()) and port_in_use(host, int(port)):
        raise RendezvousError(f"rendezvous port {port} on {host} is already in use; pick another "
                              "rdzv_endpoint port (or stop what listens there)")


def child_environment(plan: DevicePlan, metrics_file: Path | None = None) -> dict:
    """The plan's device variables, the metrics file global rank 0 appends to, and the cards' lock files that
    every process of the child holds."""
    env = plan.child_environ()
    env["PYTHONUNBUFFERED"] = "1"
    if plan.nproc_per_node > 1:  # torchrun's own default, set here so it does not print its banner
        env.setdefault("OMP_NUM_THREADS", "1")
    # the ranks never talk to MLflow; the others are this child's own, set below
    for inherited in ("MLFLOW_RUN_ID", METRICS_FILE_ENV, CARD_LOCKS_ENV, CARD_OWNER_ENV):
        env.pop(inherited, None)
    if metrics_file:
        env[METRICS_FILE_ENV] = str(metrics_file)
    if plan.uuids:  # the caller holds card_locks(plan), which made these files
        env[CARD_LOCKS_ENV] = os.pathsep.join(map(str, rank_lock_files(plan)))
        env[CARD_OWNER_ENV] = str(os.getpid())
    return env


def launch(config: Path, plan: DevicePlan, opts: Launch, nodes: Nodes, workdir: Path, log,
           metrics_file: Path | None = None, hold_fds: tuple[int, ...] = (), attempt: int = 1,
           rdzv: Rendezvous | None = None, stop: threading.Event | None = None) -> dict:
    """Run the worker for `config` with the plan's devices; its results JSON (`rank0` False on a node without
    global rank 0; `stopped` when `stop` was set)."""
    check_rendezvous(nodes)
    folder = RunFolder(workdir)
    result = folder.result
    result.unlink(missing_ok=True)
    cmd = build_command(plan, opts, nodes, config, result, rdzv)
    log.info("launching: %s", " ".join(cmd))
    env = child_environment(plan, metrics_file) | {LAUNCH_ATTEMPT_ENV: str(attempt), **error_folder(workdir)}
    if rdzv:
        env |= rdzv.environ()
    try:
        code, tail = run_child(cmd, env, workdir, log, hold_fds, log_file=folder.log("worker.log"), stop=stop)
    except Stopped:
        log.info("training stopped by the flow")
        return {"stopped": True, "final_metrics": {}}
    if code != 0:
        raise failure("training", code, workdir, tail, "worker.log")
    if not result.is_file():
        if nodes.node_rank != 0 or rdzv:  # global rank 0, which writes it, is on another machine
            return {"rank0": False, "final_metrics": {}}
        raise TrainingFailed(f"training exited 0 but wrote no {result}")
    return json.loads(result.read_text())


@task(name="launch-training", retries=0, cache_policy=NO_CACHE)
def launch_training(config: Path, plan: DevicePlan, opts: Launch, nodes: Nodes, workdir: Path,
                    metrics_file: Path | None = None, hold_fds: tuple[int, ...] = (),
                    rdzv: Rendezvous | None = None, stop: threading.Event | None = None) -> dict:
    """Run the worker with the plan's devices; stream its output; return its results JSON."""
    from prefect import get_run_logger
    from prefect.runtime import task_run

    return launch(config, plan, opts, nodes, workdir, get_run_logger(), metrics_file, hold_fds, task_run.run_count,
                  rdzv, stop)


def script_environment(plan: DevicePlan, run, tracking_uri: str) -> dict:
    """The plan's environment plus the MLflow run `run` (a TrackedRun) for the script's own mlflow calls, and its
    output folder."""
    from gpuflow.training.uris import absolute_uri

    env = child_environment(plan, run.metrics_file)
    env.pop("MLFLOW_EXPERIMENT_NAME", None)  # the run's own experiment, set below, is the one
    env |= {"MLFLOW_RUN_ID": run.run_id, "MLFLOW_EXPERIMENT_ID": run.experiment_id,
            "MLFLOW_TRACKING_URI": absolute_uri(tracking_uri),
            "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false",  # the flow runs the one monitor of the run
            **FRESH_RDZV_STORE,
            OUTPUT_DIR_ENV: str(RunFolder(run.workdir).outputs)}
    # the script's own log_metric calls queue and return: training never waits on the store's answer
    env.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "true")
    return env


@task(name="launch-script", retries=0, cache_policy=NO_CACHE)
def launch_script(script: str, script_args: list[str], opts: Launch, tracking_uri: str, plan: DevicePlan,
                  run, hold_fds: tuple[int, ...] = (), rdzv: Rendezvous | None = None,
                  stop: threading.Event | None = None, cwd: Path | None = None) -> None:
    """Run the user's script under torchrun, always (one process per device), from `cwd` (default:
    the folder gpuflow runs in), in the MLflow run `run`; stream its output to the flow's log and
    logs/script.log."""
    from prefect import get_run_logger

    log, folder = get_run_logger(), RunFolder(run.workdir)
    folder.outputs.mkdir(parents=True, exist_ok=True)
    # per-rank logs, console lines tagged by rank; training/runscript.py runs it as `python script.py` would
    cmd = [*torchrun(plan, opts, Nodes(), rdzv), f"--log-dir={folder.logs / 'ranks'}", "--tee=3",
           "--log-line-prefix-template=[rank${rank}]:", "-m", "gpuflow.training.runscript", script, *script_args]
    log.info("launching: %s", " ".join(cmd))
    env = script_environment(plan, run, tracking_uri)
    folder.process_group.unlink(missing_ok=True)  # rank 0 writes it afresh when the script ends well
    env |= {**error_folder(folder.root), DIST_TIMEOUT_ENV: str(opts.dist_timeout_s),
            PROCESS_GROUP_FILE_ENV: str(folder.process_group), **(rdzv.environ() if rdzv else {})}
    code, tail = run_child(cmd, env, cwd or Path.cwd(), log, hold_fds, log_file=folder.log("script.log"), stop=stop)
    if code != 0:
        raise failure(Path(script).name, code, folder.root, tail, "script.log")
