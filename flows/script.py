"""The train-script flow: your own torchrun script, unchanged, on the assigned devices, in one
MLflow run: probe -> assign -> (card locks, MLflow run) launch -> collect outputs -> register,
by the one job function (flows/job.py) with the script's launcher (flows/launchers.py).

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

from prefect import get_run_logger
from prefect.runtime import flow_run

from gpuflow.tasks.tracking import orphans

from .job import run_job
from .launchers import Script, stem
from .nodes import place
from .checked import checked_flow
from .params import ScriptParams
from .session import unique_name


def script_run_name() -> str:
    """The flow run's name, given when it starts: the user's run_name, else <script>-<the flow run
    id's start>; the MLflow run takes the same name."""
    p = flow_run.get_parameters()
    return p.get("run_name") or unique_name(stem({"script": p.get("script", "script")}))


@checked_flow(ScriptParams, name="train-script", flow_run_name=script_run_name,
              on_crashed=[orphans.end_flow_run_mlflow_runs], on_cancellation=[orphans.end_flow_run_mlflow_runs])
def train_script(params: ScriptParams) -> dict:
    """Run your torchrun script on the best devices of this host (or of `nodes` machines) and log one MLflow run."""
    done = place(Script(params)) if params.nodes > 1 else run_job(Script(params))
    get_run_logger().info("MLflow run %s finished; checkpoint %s; model version %s", done["run_id"],
                          done.get("checkpoint"), done.get("model_version"))
    return done
