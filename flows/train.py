"""The training pipeline flow: probe -> assign -> data -> MLflow run -> launch -> log -> end.

Run it with `gpuflow run` (or `python -m flows.train --help`), or as a deployment.
"""

from __future__ import annotations

if __name__ == "__main__":  # `python -m flows.train ...` is `gpuflow run ...`
    # Dispatched before this module's imports: the CLI starts the MLflow tracker before it
    # loads Prefect (flows/cli.py), and this module is then imported once, as flows.train.
    import sys

    from flows.cli import entry

    sys.exit(entry(["run", *sys.argv[1:]]))

import socket
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.concurrency.sync import concurrency
from prefect.runtime import deployment, flow_run

from tasks.assign import CardLocks, DevicePlan, assign_devices
from tasks.data import DatasetInfo, prepare_dataset
from tasks.launch import launch_training, preflight
from tasks.probe import EnvironmentReport, probe_environment
from tasks.mlrun import default_tracking_uri, describe_error, git_commit, status_for
from tasks.track import log_results
from tasks.tracker import Tracker, TrackerError, TrackerGone, acquire, end_run_here

from .params import PipelineParams


DEVICE_LIMIT = "gpuflow-devices-{host}"


class StepTimer:
    """Wall time per pipeline step, for the run's `pipeline.*_s` metrics and benchmarks."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, step: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[step] = round(time.perf_counter() - start, 3)


def run_name() -> str:
    p = flow_run.get_parameters()
    return (f"{p.get('model', 'mlp')}-{p.get('dataset', 'digits')}-{p.get('strategy', 'auto')}"
            f"-gpus={p.get('gpus', 'auto')}")


@flow(name="train-pipeline", flow_run_name=run_name, validate_parameters=True)
def train_pipeline(
    model: str = "mlp", dataset: str = "digits", data_root: str = "data", download: bool = False,
    val_fraction: float = 0.2, split_seed: int = 0, synthetic_size: int = 4096,
    synthetic_side: int = 28,
    epochs: int = 3, batch_size: int = 64, lr: float = 1e-3, optimizer: str = "adam",
    momentum: float = 0.9, grad_clip: float = 0.0, precision: str = "fp32",
    strategy: str = "auto", gpus: str = "auto", backend: str = "auto", min_free_mb: int = 0,
    skip_busy: bool = True, cpu_processes: int = 0, seed: int = 42, deterministic: bool = False,
    cudnn_benchmark: bool = False, num_workers: int = 0, resume: str = "auto",
    dist_timeout_s: float = 300.0, max_steps_per_epoch: int = 0, max_restarts: int = 1,
    launch_retries: int = 0, nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None,
    rdzv_timeout_s: int = 300,
    experiment: str = "gpuflow", registered_model: str = "gpuflow-model",
    tracking_uri: str | None = None, runs_dir: str = "runs",
) -> dict:
    """Train a model on the best devices of this host and log one MLflow run.

    Every parameter is a field of PipelineParams (flows/params.py), validated before any work.
    """
    params = PipelineParams(**{k: v for k, v in locals().items()})
    # Served runs on one host queue here (the limit is created by flows/serve.py); without
    # the limit, as with `make run`, this passes straight through.
    with concurrency(DEVICE_LIMIT.format(host=socket.gethostname()), occupy=1, strict=False):
        return _pipeline(params)


def _pipeline(params: PipelineParams) -> dict:
    uri = params.tracking_uri or default_tracking_uri()
    # The MLflow tracker loads MLflow on its own core while this process probes and prepares
    # (tasks/tracker.py); `gpuflow run` started it before Prefect was even imported.
    tracker = acquire() if params.node_rank == 0 else None
    try:
        return _steps(params, uri, tracker)
    finally:
        if tracker is not None:
            tracker.close()


def _steps(params: PipelineParams, uri: str, tracker: Tracker | None) -> dict:
    timer = StepTimer()
    with timer("probe"):
        report = probe_environment()
    with timer("assign"):
        plan = assign_devices(report, params.device_request(), params.batch_size, params.precision)
    locks = CardLocks()
    locks.acquire(plan)  # released below, and by the kernel if this process dies
    try:
        cfg = params.train_config(plan)
        with timer("data"):  # only downloads can flake: retry those alone
            data = prepare_dataset.with_options(retries=2 if cfg.download else 0)(cfg)
        with timer("preflight"):
            preflight(cfg, params.launch_options(params.rdzv_endpoint or "gpuflow"),
                      data.num_classes, data.input_shape)
        return train_and_track(params, uri, tracker, report, plan, data, timer)
    finally:
        locks.release()


def train_and_track(params: PipelineParams, uri: str, tracker: Tracker | None, report: EnvironmentReport,
                    plan: DevicePlan, data: DatasetInfo, timer: StepTimer) -> dict:
    """Own the MLflow run around the launch: it always ends FINISHED, FAILED or KILLED."""
    log = get_run_logger()
    run_id = None
    if tracker is not None:
        with timer("mlflow_start"):
            started = tracker.call(
                "start", uri=uri, experiment=params.experiment, run_name=flow_run.get_name() or "train",
                params=params.model_dump(mode="json"), tags=run_tags(params, plan),
                dataset=data.model_dump(mode="json"),
                artifacts=[{"obj": report.model_dump(mode="json"), "name": "environment_report.json"},
                           {"obj": plan.model_dump(mode="json"), "name": "device_plan.json"}])
        run_id = started["run_id"]
    try:
        workdir = Path(params.runs_dir).resolve() / (run_id or f"node{params.node_rank}-{uuid.uuid4().hex[:8]}")
        workdir.mkdir(parents=True, exist_ok=True)
        config = params.train_config(plan, workdir).model_copy(update={"data_cache": data.cache})
        config = config.to_json(workdir / "config.json")
        metrics_file = None
        if run_id:  # rank 0 appends its epochs here; the tracker logs them to the run as they come
            metrics_file = workdir / "metrics.jsonl"
            tracker.call("follow", run_id=run_id, path=str(metrics_file))
        launch = launch_training.with_options(retries=params.launch_retries)
        with timer("launch"):
            result = launch(config, plan, params.launch_options(rdzv_id=params.rdzv_endpoint or "gpuflow"),
                            workdir, run_id, uri, metrics_file)
        if not run_id:
            return {"node_rank": params.node_rank, "result": result, "timings": timer.seconds}
        with timer("log_results"):
            version = log_results(tracker, run_id, result, workdir, params.model, params.registered_model,
                                  data.num_classes, data.input_shape)
            summarize(params, plan, result, run_id, version, started["experiment_id"])
        tracker.call("log_metrics", run_id=run_id, metrics={f"pipeline.{k}_s": v for k, v in timer.seconds.items()})
        tracker.call("end", run_id=run_id, status="FINISHED")
        log.info("MLflow run %s finished; model %s version %s", run_id, params.registered_model, version)
        return {"run_id": run_id, "status": "FINISHED", "model_version": version, **result,
                "timings": timer.seconds}
    except BaseException as e:
        if run_id:
            end_run(tracker, uri, run_id, e)
        raise


def end_run(tracker: Tracker, uri: str, run_id: str, exc: BaseException) -> None:
    """End the run FAILED or KILLED, through the tracker, or from here if the tracker is gone."""
    try:
        tracker.call("end", timeout=120, run_id=run_id, status=status_for(exc), error=describe_error(exc))
    except (TrackerGone, TrackerError):
        end_run_here(uri, run_id, exc)


def run_tags(params: PipelineParams, plan: DevicePlan) -> dict:
    world = plan.nproc_per_node * params.nnodes
    return {
        "prefect.flow_run_id": flow_run.get_id(), "prefect.flow_run_name": flow_run.get_name(),
        "prefect.deployment": deployment.get_name(), "mlflow.source.git.commit": git_commit(),
        "strategy": plan.strategy, "world_size": world, "backend": plan.backend,
        "device": plan.device, "physical_gpus": ",".join(map(str, plan.physical_ids)) or "none",
        "primary_gpu": plan.primary if plan.primary is not None else "none",
        "dataset": params.dataset, "model": params.model,
    }


def summarize(params: PipelineParams, plan: DevicePlan, result: dict, run_id: str, version: str,
              experiment_id: str) -> None:
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
            f"**MLflow run**: `{run_id}` (`make ui`, then http://127.0.0.1:5000/#/experiments/"
            f"{experiment_id}/runs/{run_id})  \n"
            f"**Registered model**: {params.registered_model} v{version}\n\n"
            f"| metric | value |\n|---|---|\n{rows}\n"
        ),
    )

