"""The train-script flow: your own torchrun script, unchanged, on the assigned devices, in one MLflow run, by the
one job function (flows/job.py) with the script's launcher; docs/scripts.md says what the script gets.
"""

from __future__ import annotations

from prefect import get_run_logger

from gpuflow.tasks.tracking import orphans

from .job import run_job
from .launchers import Script, flow_run_name
from .nodes import place
from .checked import checked_flow
from .params import ScriptParams


@checked_flow(ScriptParams, name="train-script", flow_run_name=flow_run_name,
              on_crashed=[orphans.end_flow_run_mlflow_runs], on_cancellation=[orphans.end_flow_run_mlflow_runs])
def train_script(params: ScriptParams) -> dict:
    """Run your torchrun script on the best devices of this host (or of `nodes` machines) and log one MLflow run."""
    done = place(Script(params)) if params.nodes > 1 else run_job(Script(params))
    get_run_logger().info("MLflow run %s finished; checkpoint %s; model version %s", done["run_id"],
                          done.get("checkpoint"), done.get("model_version"))
    return done
