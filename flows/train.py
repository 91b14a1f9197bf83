"""The training pipeline flow: gpuflow's worker, run by the one job function (flows/job.py); started by
`gpuflow run`, a deployment, or from Python (gpuflow.flows: train_pipeline).
"""

from __future__ import annotations

from prefect import get_run_logger

from gpuflow.tasks.tracking import orphans

from .job import run_job
from .launchers import Worker, flow_run_name
from .nodes import place
from .checked import checked_flow
from .params import PipelineParams


@checked_flow(PipelineParams, name="train-pipeline", flow_run_name=flow_run_name,
              on_crashed=[orphans.end_flow_run_mlflow_runs], on_cancellation=[orphans.end_flow_run_mlflow_runs])
def train_pipeline(params: PipelineParams) -> dict:
    """Train a model on the best devices of this host (or of `nodes` machines) and log one MLflow run."""
    done = place(Worker(params)) if params.nodes > 1 else run_job(Worker(params))
    if done.get("run_id"):
        get_run_logger().info("MLflow run %s finished; model %s version %s", done["run_id"],
                              params.registered_model, done.get("model_version"))
    return done
