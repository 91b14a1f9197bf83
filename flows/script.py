"""The train-script flow: your own torchrun script, unchanged, on the assigned devices, in one
MLflow run: probe -> assign -> (card locks, MLflow run) launch -> collect outputs -> register.

    gpuflow run --script train_ddp.py --gpus 2 -- --lr 0.01 --epochs 5
    prefect deployment run 'train-script/default' -p script=train_ddp.py -p script_args='["--lr","0.01"]'

The script always runs under torchrun (one process per device; `LOCAL_RANK`, `RANK` and the
env:// rendezvous exist as it expects), from the folder gpuflow runs in, with:
  MLFLOW_RUN_ID, MLFLOW_TRACKING_URI (absolute), MLFLOW_EXPERIMENT_ID: its `mlflow.start_run()`
      attaches to the flow's run; the flow sets the run's final status and name at the end;
  GPUFLOW_OUTPUT_DIR: an absolute folder, the same across torchrun restarts; what the script
      writes there is logged as artifacts, and the newest state dict is de-prefixed and logged
      as the run's checkpoint;
  GPUFLOW_METRICS_FILE: where gpuflow.training.helper.report() appends metrics for the flow.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from gpuflow.tasks.tracking import orphans, results, tracked
from gpuflow.tasks.launch import Rendezvous, TrainingFailed, launch_script
from gpuflow.training.contract import RunFolder

from .nodes import NodeJob, attach, in_node_folder, node_name, place, publish, rendezvous
from .params import ScriptParams, flat_parameters
from .session import Session, training_session, unique_name


def script_run_name() -> str:
    """The flow run's name, given when it starts: the user's run_name, else <script>-<the flow run
    id's start>; the MLflow run takes the same name."""
    p = flow_run.get_parameters()
    return p.get("run_name") or unique_name(Path(p.get("script", "script")).stem)


@flow(name="train-script", flow_run_name=script_run_name, validate_parameters=False,
      on_crashed=[orphans.end_flow_run_mlflow_runs], on_cancellation=[orphans.end_flow_run_mlflow_runs])
@flat_parameters(ScriptParams)
def train_script(params: ScriptParams) -> dict:
    """Run your torchrun script on the best devices of this host (or of `nodes` machines) and log one MLflow run."""
    if params.nodes > 1:
        return place(params, Path(params.script).stem, {"script": params.script}, "script-node")
    with training_session(params) as s, \
            s.run(Path(params.script).stem, {"script": params.script}, s.plan.nproc_per_node) as run:
        run.log_params(params.run_params(s.plan))
        outputs = run_script(params, s, run)
        version = register(run, outputs, params)
    get_run_logger().info("MLflow run %s finished; checkpoint %s; model version %s", run.run_id,
                          outputs.get("checkpoint"), version)
    return {"run_id": run.run_id, "status": "FINISHED", "model_version": version,
            "world_size": s.plan.nproc_per_node, **outputs}


def run_script(params: ScriptParams, s: Session, run: tracked.TrackedRun, rdzv: Rendezvous | None = None,
               stop=None, cwd: Path | None = None) -> dict:
    """Launch the script from `cwd` (default: here), relaying its metrics; then (failed too) log its
    files and logs. Setting `stop` (a threading.Event: a sweep's pruner) stops it: Stopped is raised."""
    launched = time.time()  # collected files older than this were not written by the script
    try:
        with run.relaying_metrics():
            launch_script(params.script, params.script_args, params, params.tracking_uri, s.plan, run, s.cards, rdzv,
                          stop, cwd)
    except TrainingFailed:  # the failed script's files and logs are kept in the run too
        collect_outputs(run, params.collect, launched, cwd)
        raise
    return collect_outputs(run, params.collect, launched, cwd)


class ScriptNodeParams(ScriptParams):
    """A node's part of a placed script run: the run's parameters, and the job."""

    job: NodeJob


@flow(name="script-node", flow_run_name=node_name, validate_parameters=False)
@in_node_folder
@flat_parameters(ScriptNodeParams)
def script_node(params: ScriptNodeParams) -> dict:
    """One machine's part of a placed script run (started by the parent flow, never by hand): the
    node whose processes hold global rank 0 logs the script's files and registers its model; the
    others log their logs under nodes/<node>/."""
    job = params.job
    with training_session(params) as s:
        rdzv = rendezvous(job, params.nodes, params.rdzv_timeout_s)
        run = attach(params, job, s)
        if job.index == 0:
            run.log_params(params.run_params(s.plan))
        try:
            with run.relaying_metrics():
                launch_script(params.script, params.script_args, params, params.tracking_uri, s.plan, run, s.cards,
                              rdzv)
        finally:
            rank0 = RunFolder(run.workdir).process_group.is_file()  # rank 0 leaves it when the script ends
            if not rank0:
                from gpuflow.tasks.scriptout import log_node_logs

                log_node_logs(run, job.name)
        if not rank0:
            return {"node": job.name, "rank0": False}
        outputs = collect_outputs(run, params.collect, None)
        version = register(run, outputs, params)
        publish(job, {"model_version": version, "world_size": params.world_size(s.plan), **outputs})
    return {"node": job.name, "rank0": True, "model_version": version}


@task(name="collect-outputs", cache_policy=NO_CACHE)
def collect_outputs(run: tracked.TrackedRun, patterns: list[str], launched: float | None,
                    cwd: Path | None = None) -> dict:
    """Log the output folder, the `collect` files and the logs; de-prefix the newest state dict
    and log it as the run's checkpoint (or log it unchanged and say why). Tag and warn about
    collected files older than `launched`, and about processes that never joined a process group."""
    from gpuflow.tasks.scriptout import flag_not_distributed, gather

    flag_not_distributed(run)
    return gather(run, patterns, cwd or Path.cwd(), launched)


@task(name="register-model", cache_policy=NO_CACHE)
def register(run: tracked.TrackedRun, outputs: dict, params: ScriptParams, how: str | None = None) -> str | None:
    """Register the checkpoint as a model when the script declared its class (helper.declare_model);
    `how` it was trained goes into the version's description (default: the run)."""
    spec = outputs.get("model_spec")
    if not spec or not outputs.get("weights"):
        get_run_logger().info("no model registered: %s", "the script declared no model (gpuflow.training.helper."
                              "declare_model)" if not spec else "no state dict was found")
        return None
    description = f"{spec['reference']} trained by {Path(params.script).name} {how or f'(run {run.run_id})'}"
    return results.register_model(run, {"model_spec": spec, "weights": outputs["weights"]}, params.registered_model,
                                  str(Path.cwd()), description)

