"""The config, the data step and the preflight of gpuflow's own worker, which a run on one machine and each
node of a placed run take alike."""

from __future__ import annotations

from pathlib import Path

from gpuflow.tasks.data import DatasetInfo, prepare_dataset
from gpuflow.tasks.devices.assign import DevicePlan
from gpuflow.tasks.failure import would_repeat
from gpuflow.tasks.preflight import preflight
from gpuflow.training.config import TrainConfig, Training
from gpuflow.training.contract import RunFolder

from .params import PipelineParams
from .session import Session


def worker_config(params: PipelineParams, plan: DevicePlan, data: DatasetInfo | None = None,
                  folder: RunFolder | None = None, checkpoint_each_epoch: bool = True) -> TrainConfig:
    """The worker's config from the request, the plan, the prepared data and the run's folder (none yet for the
    data step and the preflight); the user's code imports from the folder the flow runs in."""
    return TrainConfig(
        **params.model_dump(include=set(Training.model_fields)), dist_timeout_s=params.dist_timeout_s,
        strategy=plan.strategy, device=plan.device,
        device_ids=plan.logical_ids if plan.strategy == "dp" and plan.device == "cuda" else None,
        code_root=str(Path.cwd()), data_cache=data and data.cache, num_classes=data and data.num_classes,
        checkpoint_each_epoch=checkpoint_each_epoch, **({"checkpoint_dir": str(folder.checkpoints)} if folder else {}))


def retry_unless_it_repeats(task, task_run, state) -> bool:
    """Retry what a retry can mend (a flaky download, a rank killed outright), never a refusal
    of bad input or a failure the ranks said would only repeat."""
    try:
        state.result()
    except Exception as e:  # noqa: BLE001 - a task's failure, whatever it is
        return not would_repeat(e)
    return True


def prepared(params: PipelineParams, s: Session) -> DatasetInfo:
    """The dataset prepared once (downloads retried, nothing else), then one batch of the user's
    code checked on the CPU; with the class count the worker trains with."""
    with s.timer("data"):
        data = prepare_dataset.with_options(retries=2 if params.download else 0,
                                            retry_condition_fn=retry_unless_it_repeats)(worker_config(params, s.plan))
    with s.timer("preflight"):
        classes = preflight(worker_config(params, s.plan, data), params, data, params.world_size(s.plan))
    return data.model_copy(update={"num_classes": classes})
