"""The pipeline's parameters: one flat, validated model (training config + devices + launch).

Flat on purpose: `prefect deployment run 'train-pipeline/ddp' -p epochs=3` and
`gpuflow run --epochs 3` name fields directly, and the Prefect UI renders one form.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from tasks.assign import DevicePlan, DeviceRequest
from tasks.launch import LaunchOptions
from training import TrainConfig

# Set from the DevicePlan and the run's folder, never by the user.
PLAN_OWNED = ("device", "device_ids", "checkpoint_dir", "data_cache")


class PipelineParams(TrainConfig):
    strategy: Literal["auto", "single", "dp", "ddp"] = Field(  # type: ignore[assignment]
        "auto", description="auto: ddp for several devices (gloo on CPU), single for one")
    gpus: str = Field("auto", description=DeviceRequest.model_fields["gpus"].description)
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    min_free_mb: int = Field(0, ge=0, description="refuse/skip GPUs with less free memory")
    skip_busy: bool = Field(True, description="skip GPUs already running other processes")
    cpu_processes: int = Field(0, ge=0, description="DDP processes on a CPU-only host (0 = auto)")
    max_restarts: int = Field(1, ge=0, description="torchrun elastic restarts after a worker dies")
    launch_retries: int = Field(0, ge=0, description="Prefect retries of the launch (resume from checkpoint)")
    nnodes: int = Field(1, ge=1, description="machines in a multi-node DDP job")
    node_rank: int = Field(0, ge=0, description="this machine's rank; only node 0 owns the MLflow run")
    rdzv_endpoint: str | None = Field(None, description="host:port of node 0's rendezvous (multi-node)")
    rdzv_timeout_s: int = Field(300, gt=0, description="fail when not every node arrives in time")
    experiment: str = Field("gpuflow", description="MLflow experiment name")
    registered_model: str = Field("gpuflow-model", description="Model Registry name")
    tracking_uri: str | None = Field(None, description="MLflow URI (default: MLFLOW_TRACKING_URI "
                                     "or sqlite:///<project>/mlflow.db)")
    runs_dir: str = Field("runs", description="folder for per-run configs, checkpoints and logs")

    @model_validator(mode="after")
    def _multinode(self) -> "PipelineParams":
        if self.nnodes > 1 and self.strategy in ("single", "dp"):
            raise ValueError(f"nnodes={self.nnodes} needs strategy 'ddp' (or 'auto'), not {self.strategy!r}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(f"nnodes={self.nnodes} needs rdzv_endpoint=<node 0 host>:<port>, "
                             "the same on every node")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be below nnodes {self.nnodes}")
        self.device_request()  # the device request's own checks (gpus form, duplicates) now
        return self

    def device_request(self) -> DeviceRequest:
        strategy = "ddp" if self.nnodes > 1 else self.strategy  # one process per node is still DDP
        return DeviceRequest(gpus=self.gpus, strategy=strategy, backend=self.backend,
                             min_free_mb=self.min_free_mb, skip_busy=self.skip_busy,
                             cpu_processes=self.cpu_processes)

    def launch_options(self, rdzv_id: str) -> LaunchOptions:
        return LaunchOptions(max_restarts=self.max_restarts, nnodes=self.nnodes,
                             node_rank=self.node_rank, rdzv_endpoint=self.rdzv_endpoint,
                             rdzv_id=rdzv_id, rdzv_timeout_s=self.rdzv_timeout_s)

    def train_config(self, plan: DevicePlan | None = None, workdir: Path | None = None) -> TrainConfig:
        """The worker's config; with a plan, strategy and devices come from it."""
        fields = {k: v for k, v in self.model_dump().items() if k in TrainConfig.model_fields}
        fields["strategy"] = plan.strategy if plan else "single"
        if plan:
            fields["device"] = plan.device
            fields["device_ids"] = plan.logical_ids if plan.strategy == "dp" and plan.device == "cuda" else None
        if workdir:
            fields["checkpoint_dir"] = str(workdir / "checkpoints")
        return TrainConfig(**fields)


def user_fields() -> dict:
    """Fields a user sets (flow parameters / CLI options): everything but plan-owned ones."""
    return {k: f for k, f in PipelineParams.model_fields.items() if k not in PLAN_OWNED}
