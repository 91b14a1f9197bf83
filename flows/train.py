"""The training pipeline flow: probe -> assign -> (card locks) data -> preflight ->
(MLflow run) launch -> log results.

Run it with `gpuflow run`, as a deployment, or from Python (gpuflow.flows: train_pipeline).
"""

from __future__ import annotations

import uuid
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from gpuflow.tasks.tracking import orphans, results, tracked
from gpuflow.tasks.devices.assign import DevicePlan
from gpuflow.tasks.data import DatasetInfo
from gpuflow.tasks.launch import launch_training
from gpuflow.training.contract import RunFolder

from .nodes import place
from .params import PipelineParams, flat_parameters, worker_config
from .prepared import prepared, retry_unless_it_repeats
from .session import Session, training_session, unique_name
from .settings import Settings


def run_name() -> str:
    """The flow run's name, given when it starts (flow_run_name): the user's run_name, else
    <model>-<dataset>-<the flow run id's start>. The MLflow run takes the same name, so each
    run is found by one name in both UIs."""
    p = flow_run.get_parameters()
    return p.get("run_name") or unique_name(f"{dataset_label(p.get('model', 'mlp'))}-"
                                            f"{dataset_label(p.get('dataset', 'digits'))}")


def dataset_label(dataset: str) -> str:
    """imagefolder:/data/pets -> pets; myproj.data:datasets -> datasets; built-in names as they are."""
    if dataset.startswith("imagefolder:"):
        return Path(dataset.split(":", 1)[1]).name
    return dataset.rpartition(":")[2] if ":" in dataset else dataset


@flow(name="train-pipeline", flow_run_name=run_name, validate_parameters=False,
      on_crashed=[orphans.end_flow_run_mlflow_runs], on_cancellation=[orphans.end_flow_run_mlflow_runs])
@flat_parameters(PipelineParams)
def train_pipeline(params: PipelineParams) -> dict:
    """Train a model on the best devices of this host (or of `nodes` machines) and log one MLflow run."""
    if params.nodes > 1:
        return place(params, f"{dataset_label(params.model)}-{dataset_label(params.dataset)}",
                     {"dataset": params.dataset, "model": params.model}, "train-node")
    with training_session(params, params.batch_size, params.precision) as s:
        return pipeline(params, s)


def pipeline(params: PipelineParams, s: Session) -> dict:
    plan, timer = s.plan, s.timer
    data = prepared(params, s)
    if params.node_rank != 0:  # node 0 owns the MLflow run; the other nodes only train
        folder = RunFolder(Path(params.runs_dir).resolve() / f"node{params.node_rank}-{uuid.uuid4().hex[:8]}")
        return {"node_rank": params.node_rank, "result": train(params, s, data, folder), "timings": timer.seconds}
    stem = f"{dataset_label(params.model)}-{dataset_label(params.dataset)}"
    with s.run(stem, {"dataset": params.dataset, "model": params.model}, params.world_size(plan),
               data.model_dump(mode="json")) as run:
        result = train(params, s, data, RunFolder(run.workdir), run)
        with timer("log_results"):
            version = results.log_results(run, result, params.registered_model, str(Path.cwd()),
                                          describe_version(params, plan, result, s.name))
        summarize(params, plan, result, run, version)
        # grouped apart in the MLflow UI, so loss and accuracy lead the run's charts
        run.log_metrics({f"pipeline/{k}_s": v for k, v in timer.seconds.items()})
    get_run_logger().info("MLflow run %s finished; model %s version %s", run.run_id,
                          params.registered_model, version)
    return {"run_id": run.run_id, "status": "FINISHED", "model_version": version, **result,
            "timings": timer.seconds}


def train(params: PipelineParams, s: Session, data: DatasetInfo, folder: RunFolder,
          run: tracked.TrackedRun | None = None, on_metrics=None, stop=None) -> dict:
    """Write the worker's config, record it as the run's params (a node other than 0 has no run and
    logs nothing), launch, and relay rank 0's metrics (each epoch's also to `on_metrics`; setting
    `stop` stops the launch: a sweep's pruner)."""
    config = worker_config(params, s.plan, data, folder)
    launch = launch_training.with_options(retries=params.launch_retries, retry_condition_fn=retry_unless_it_repeats)
    if run is None:
        with s.timer("launch"):
            return launch(config.to_json(folder.config), s.plan, params, params, folder.root, hold_fds=s.cards)
    run.log_params(params.run_params(config, s.plan))
    with s.timer("launch"), run.relaying_metrics(on_metrics):
        return launch(config.to_json(folder.config), s.plan, params, params, folder.root, run.metrics_file,
                      hold_fds=s.cards, stop=stop)


def describe_version(params: PipelineParams, plan: DevicePlan, result: dict, name: str) -> str:
    """The registered version's description: what it is, how it was trained, how well it does."""
    m = result["final_metrics"]
    scores = ", ".join(f"{k} {v:.4f}" for k, v in m.items() if k.startswith("val_") or k == "train_loss")
    return (f"{params.model} trained on {params.dataset} by run {name}: {result['epochs_run']} epochs, "
            f"{plan.strategy} on {plan.describe()}, batch {params.batch_size}, lr {params.lr}, {params.precision}. "
            f"Final {scores}. Input and output: float32 arrays as in the signature ({params.objective}).")


def summarize(params: PipelineParams, plan: DevicePlan, result: dict, run: tracked.TrackedRun,
              version: str) -> None:
    m = result["final_metrics"]
    rows = "\n".join(f"| {k} | {v:.4f} |" for k, v in m.items())
    create_markdown_artifact(
        key="training-summary",
        description=f"{params.model} on {params.dataset}",
        markdown=(
            f"# {params.model} on {params.dataset}\n\n"
            f"**Devices**: {plan.describe()} ({plan.strategy}, {plan.backend}, "
            f"world size {result['world_size']})  \n"
            f"**Epochs run**: {result['epochs_run']}  \n"
            f"**MLflow run**: `{run.run_id}` (`gpuflow ui`, then {Settings().mlflow_ui_url}/#/experiments/"
            f"{run.experiment_id}/runs/{run.run_id})  \n"
            f"**Registered model**: {params.registered_model} v{version}\n\n"
            f"| metric | value |\n|---|---|\n{rows}\n"
        ),
    )

