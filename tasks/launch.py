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
from typing import TYPE_CHECKING

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from gpuflow.training.compat import FRESH_RDZV_STORE
from gpuflow.training.errors import UserError
from gpuflow.training.contract import (CARD_LOCKS_ENV, CARD_OWNER_ENV, DIST_TIMEOUT_ENV, EPOCH_LINE,
                                       LAUNCH_ATTEMPT_ENV, METRICS_FILE_ENV, OUTPUT_DIR_ENV, PROCESS_GROUP_FILE_ENV,
                                       RunFolder, ran_to_the_end)

from .child import Stopped, run_child
from .failure import TrainingFailed, error_folder, failure
from .devices.assign import DevicePlan
from .devices.cards import CardLocks

if TYPE_CHECKING:  # the request: the flows' parameters
    from gpuflow.flows.params import Nodes, PipelineParams, ScriptParams


class Rendezvous(BaseModel):
    """A placed job's static rendezvous: every node's agent joins the store node 0's agent hosts at `endpoint`, as
    node `rank` (torchrun's c10d rendezvous would unpickle the state its store holds: whoever reaches that port could
    run code in every agent)."""

    endpoint: str
    id: str
    nnodes: int
    rank: int
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


def torchrun(plan: DevicePlan, opts: PipelineParams | ScriptParams, rdzv: Rendezvous | None,
             log_dir: Path) -> list[str]:
    """torchrun with the plan's processes per node, restarts and rendezvous; its per-attempt folders in `log_dir`
    (in the run's folder, not a /tmp/torchelastic_* of each launch left behind)."""
    # no --tee for the worker: its log-tailing threads once kept a signalled torchrun from exiting (--log-dir alone
    # starts none)
    restarts = 0 if rdzv else opts.max_restarts  # placed: a node that fails fails the job
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={plan.nproc_per_node}",
           f"--max-restarts={restarts}", "--role=rank", f"--log-dir={log_dir}"]
    if rdzv:  # its peers leave within a second; restarting them would resume from different checkpoints
        host, _, port = rdzv.endpoint.rpartition(":")
        return [*cmd, f"--nnodes={rdzv.nnodes}", f"--node-rank={rdzv.rank}", f"--master-addr={host}",
                f"--master-port={port}", f"--local-addr={rdzv.local_addr}",
                f"--rdzv-conf=timeout={opts.rdzv_timeout_s}"]
    if getattr(opts, "nnodes", 1) == 1 and not getattr(opts, "rdzv_endpoint", None):  # all ranks here
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
    if host in ("127.0.0.1", "localhost", "0.0.0.0", socket.gethostname()) and port_in_use(host, int(port)):
        raise RendezvousError(f"rendezvous port {port} on {host} is already in use; pick another "
                              "rdzv_endpoint port (or stop what listens there)")


def child_environment(plan: DevicePlan, metrics_file: Path | None = None) -> dict:
    """The plan's device variables, the metrics file global rank 0 appends to, and the cards' lock files that
    every process of the child holds."""
    env = {**os.environ, **plan.env}
    env["PYTHONUNBUFFERED"] = "1"
    if plan.cpu_threads or plan.nproc_per_node > 1:  # the plan's share of the CPUs; torchrun's own default, 1,
        env.setdefault("OMP_NUM_THREADS", str(plan.cpu_threads or 1))  # set here so it prints no banner
    # the ranks never talk to MLflow; the others are this child's own, set below
    for inherited in ("MLFLOW_RUN_ID", METRICS_FILE_ENV, CARD_LOCKS_ENV, CARD_OWNER_ENV):
        env.pop(inherited, None)
    if metrics_file:
        env[METRICS_FILE_ENV] = str(metrics_file)
    if plan.uuids:  # the caller holds card_locks(plan), which made these files
        env[CARD_LOCKS_ENV] = os.pathsep.join(str(CardLocks().path(u, "ranks")) for u in plan.uuids)
        env[CARD_OWNER_ENV] = str(os.getpid())
    return env


def launch(config: Path, plan: DevicePlan, opts: PipelineParams, workdir: Path, log,
           metrics_file: Path | None = None, hold_fds: tuple[int, ...] = (), attempt: int = 1,
           rdzv: Rendezvous | None = None, stop: threading.Event | None = None) -> dict:
    """Run the worker for `config` with the plan's devices; its results JSON (`rank0` False on a node without
    global rank 0; `stopped` when `stop` was set)."""
    check_rendezvous(opts)
    folder = RunFolder(workdir)
    result = folder.result
    result.unlink(missing_ok=True)
    cmd = [*(torchrun(plan, opts, rdzv, folder.torchrun) if plan.strategy == "ddp" else [sys.executable]),
           "-m", "gpuflow.training", "--config", str(config), "--result", str(result)]
    log.info("launching: %s", " ".join(cmd))
    env = child_environment(plan, metrics_file) | {LAUNCH_ATTEMPT_ENV: str(attempt), **error_folder(workdir)}
    if rdzv:
        env |= rdzv.environ()
    try:
        code, tail = run_child(cmd, env, workdir, log, hold_fds, log_file=folder.logs / "worker.log", stop=stop,
                               progress=EPOCH_LINE)
    except Stopped:
        log.info("training stopped by the flow")
        return {"stopped": True, "final_metrics": {}}
    if code != 0:
        raise failure("training", code, workdir, tail, "worker.log")
    if not result.is_file():
        if opts.node_rank != 0 or rdzv:  # global rank 0, which writes it, is on another machine
            return {"rank0": False, "final_metrics": {}}
        raise TrainingFailed(f"training exited 0 but wrote no {result}")
    return json.loads(result.read_text())


@task(name="launch-training", retries=0, cache_policy=NO_CACHE)
def launch_training(config: Path, plan: DevicePlan, opts: PipelineParams, workdir: Path,
                    metrics_file: Path | None = None, hold_fds: tuple[int, ...] = (),
                    rdzv: Rendezvous | None = None, stop: threading.Event | None = None) -> dict:
    """Run the worker with the plan's devices; stream its output; return its results JSON."""
    from prefect import get_run_logger
    from prefect.runtime import task_run

    return launch(config, plan, opts, workdir, get_run_logger(), metrics_file, hold_fds, task_run.run_count, rdzv,
                  stop)


@task(name="launch-script", retries=0, cache_policy=NO_CACHE)
def launch_script(opts: ScriptParams, plan: DevicePlan, run, hold_fds: tuple[int, ...] = (),
                  rdzv: Rendezvous | None = None, stop: threading.Event | None = None, cwd: Path | None = None) -> bool:
    """Run the user's script (`opts.script`) under torchrun, always (one process per device), from `cwd` (default:
    the folder gpuflow runs in), in the MLflow run `run`; stream its output to the flow's log and
    logs/script.log. True when `stop` stopped it (a pruned trial: an outcome, not a failed task)."""
    from prefect import get_run_logger

    from gpuflow.training.uris import absolute_uri

    log, folder = get_run_logger(), RunFolder(run.workdir)
    folder.outputs.mkdir(parents=True, exist_ok=True)
    # per-rank logs, console lines tagged by rank; training/runscript.py runs it as `python script.py` would
    cmd = [*torchrun(plan, opts, rdzv, folder.logs / "ranks"), "--tee=3", "--log-line-prefix-template=[rank${rank}]:",
           "-m", "gpuflow.training.runscript", opts.script, *opts.script_args]
    log.info("launching: %s", " ".join(cmd))
    env = child_environment(plan, run.metrics_file)
    env.pop("MLFLOW_EXPERIMENT_NAME", None)  # the run's own experiment, set below, is the one
    # the script's own log_metric calls queue and return: training never waits on the store's answer
    env = {"MLFLOW_ENABLE_ASYNC_LOGGING": "true", **env, **FRESH_RDZV_STORE, **error_folder(folder.root),
           "MLFLOW_RUN_ID": run.run_id, "MLFLOW_EXPERIMENT_ID": run.experiment_id,
           "MLFLOW_TRACKING_URI": absolute_uri(opts.tracking_uri),
           "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false",  # the flow runs the one monitor of the run
           OUTPUT_DIR_ENV: str(folder.outputs), DIST_TIMEOUT_ENV: str(opts.dist_timeout_s),
           PROCESS_GROUP_FILE_ENV: str(folder.process_group), **(rdzv.environ() if rdzv else {})}
    folder.process_group.unlink(missing_ok=True)  # rank 0 writes it afresh when the script ends well
    try:
        code, tail = run_child(cmd, env, cwd or Path.cwd(), log, hold_fds, log_file=folder.logs / "script.log",
                               stop=stop)
    except Stopped:
        return True
    # this machine's ranks (a placed run's other nodes judge theirs: the job stands only if every node does)
    if code != 0 and ran_to_the_end(folder.errors, plan.nproc_per_node):
        log.warning(f"{Path(opts.script).name}: every rank ran the script to its end, then a process failed as it "
                    f"exited (torchrun's exit code {code}; gloo's exit abort, pytorch#190489): the run stands")
    elif code != 0:
        raise failure(Path(opts.script).name, code, folder.root, tail, "script.log")
    return False
