"""Every parameter of gpuflow's flows, declared once (type, default, bounds, help): the parts below, composed into
each flow's model, from which the flows' signatures, the CLI, the Prefect form and the deployments derive. Field types
and pure checks: flows/fields.py; the worker's own fields: `training/config.py Training`. Flat on purpose:
`-p epochs=3` and `--epochs 3` name fields directly.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from gpuflow.tasks.devices.assign import GPUS_HELP, DevicePlan, explicit_ids, parse_gpus
from gpuflow.training.config import DistTimeout, TrainConfig, Training, absolute
from gpuflow.training.policy import check_not_tracking_store

from .fields import (NO_SUCH_FILE, SCRIPT, Collect, InputFile, Name, OneDevice, RegisteredModel, ScriptArgs,
                     ScriptFile, TrackingUri, Version, check_endpoint, check_parallel, check_storage)
from .settings import DottedName, PoolName
from .space import SweepError, check_metric, check_script_space, check_space, read_space, script_arguments


class Devices(BaseModel):
    """Which cards, and how they are shared."""

    strategy: Literal["auto", "single", "dp", "ddp"] = Field(
        "auto", description="auto: ddp for several devices (gloo on CPU), single for one")
    gpus: Annotated[str, AfterValidator(parse_gpus), Field(description=GPUS_HELP)] = "auto"
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="DDP backend; auto: nccl on GPUs, gloo on CPU")
    min_free_mb: int = Field(0, ge=0, le=10_000_000, description="refuse/skip GPUs with less free memory")
    skip_busy: bool = Field(True, description="skip GPUs already running other processes")
    cpu_processes: int = Field(0, ge=0, description="DDP processes on a CPU-only host (0 = auto; "
                               "at most the host's CPU count)")
    cpu_cores: int = Field(0, ge=0, description="CPU cores a CPU run's processes share, each running cores / processes "
                           "threads (0 = the host's; a sweep gives each trial its slot's)")


class Torchrun(BaseModel):
    """How torchrun starts and restarts the ranks."""

    max_restarts: int = Field(1, ge=0, le=100, description="torchrun elastic restarts after a worker dies")
    dist_timeout_s: DistTimeout = 300.0


class Machines(BaseModel):
    """The machines of a job: one by default; several placed by the flow on the node pool's machines."""

    nodes: int = Field(1, ge=1, le=1024, description="machines to train on, placed by the flow through the "
                       "Prefect work pool node_pool (each machine runs `gpuflow node`); --gpus applies on each; "
                       "MIN:MAX (e.g. 1:2) sets min_nodes too", json_schema_extra={"cli": "range"})
    min_nodes: int | None = Field(None, ge=1, le=1024, description="placed runs with max_node_failures: the fewest "
                                  "machines the run goes on with when a lost one has no spare within rdzv_timeout_s "
                                  "(the batch split over fewer processes, the change logged); default: nodes")
    node_pool: PoolName = Field("gpuflow-nodes",
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
    def _replaceable(self) -> "Machines":
        if self.max_node_failures and self.nodes < 2:
            raise ValueError(f"max_node_failures={self.max_node_failures} replaces machines of a run placed on "
                             "several (nodes > 1); drop it, or set nodes")
        if self.min_nodes is not None and self.min_nodes > self.nodes:
            raise ValueError(f"min_nodes={self.min_nodes} is above nodes={self.nodes}; give MIN:MAX with MIN <= MAX")
        if self.min_nodes is not None and self.min_nodes < self.nodes and not self.max_node_failures:
            raise ValueError(f"nodes {self.min_nodes}:{self.nodes} goes on with fewer machines after losing one; "
                             "set max_node_failures (how many machines may be lost), e.g. --max-node-failures 1")
        return self


class Nodes(Machines):
    """Machines, and the low-level path: a job started by hand on each machine (nnodes, node_rank, rdzv_endpoint)."""

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


class Tracking(BaseModel):
    """Where and under which names a run is recorded, not how it trains: none of it is among the run's params."""

    experiment: Name = Field("gpuflow", description="MLflow experiment name")
    run_name: Name | None = Field(None, description="the MLflow and Prefect run name; unset, it is "
                                  "<model>-<dataset>-<6 hex of the flow run id> (<script>-<id> for a script)")
    registered_model: RegisteredModel = "gpuflow-model"
    tracking_uri: TrackingUri = None
    runs_dir: str = Field("runs", description="folder for per-run configs, checkpoints and logs")


class PipelineParams(Tracking, Nodes, Torchrun, Devices, Training):
    """The train pipeline's parameters: the training, device, launch, node and tracking parts."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)

    launch_retries: int = Field(0, ge=0, le=10, description="Prefect retries of the launch (resume from checkpoint)")

    @model_validator(mode="after")
    def _fits(self) -> "PipelineParams":
        machines = max(self.nnodes, self.nodes)
        if machines > 1 and self.strategy in ("single", "dp"):
            raise ValueError(f"{machines} nodes need strategy 'ddp' (or 'auto'), not {self.strategy!r}")
        if machines > 1:
            self.strategy = "ddp"  # one process per node is still DDP
        return self

    def world_size(self, plan: DevicePlan) -> int:
        """Processes in the whole job: the plan's per node, times the nodes."""
        return plan.nproc_per_node * max(self.nnodes, self.nodes)

    def run_params(self, config: TrainConfig, plan: DevicePlan) -> dict:
        """The MLflow run's params: the worker's config as it ran, plus the launch's settings."""
        launch = self.model_dump(mode="json", exclude={*Training.model_fields, *RECORD_KEEPING})
        return {**launch, "backend": plan.backend, "nproc_per_node": plan.nproc_per_node,
                "world_size": self.world_size(plan), **config.to_dict()}


# Where a run is recorded, not how it trains: left out of the run's params.
RECORD_KEEPING = (*Tracking.model_fields, "node_rank", "rdzv_endpoint", "node_pool", "job")


class ScriptParams(Tracking, Machines, Torchrun, Devices):
    """The train-script flow: your own torchrun script on the assigned devices, in one MLflow run."""

    model_config = ConfigDict(extra="forbid")

    script: ScriptFile = Field(description="your training script (.py), run by torchrun from the folder gpuflow "
                               "runs in")
    script_args: ScriptArgs = []
    collect: Collect = []
    strategy: Literal["auto", "single", "ddp"] = Field(  # type: ignore[assignment]
        "auto", description="auto: one process per device; the script wraps its model itself (DDP or none)")

    @model_validator(mode="after")
    def _placed(self) -> "ScriptParams":
        if self.nodes > 1 and self.strategy == "single":
            raise ValueError(f"nodes={self.nodes} runs the script in several processes: use strategy 'ddp' or "
                             "'auto'")
        return self

    def world_size(self, plan: DevicePlan) -> int:
        return plan.nproc_per_node * self.nodes

    def run_params(self, plan: DevicePlan) -> dict:
        """gpuflow's own params for the run, under `gpuflow.` so they never collide with the script's."""
        mine = self.model_dump(mode="json", exclude=set(RECORD_KEEPING))
        mine |= {"backend": plan.backend, "nproc_per_node": plan.nproc_per_node, "world_size": self.world_size(plan),
                 "device": plan.device}
        return {f"gpuflow.{k}": v for k, v in mine.items()}


class RetrainParams(PipelineParams):
    """The retrain flow: a challenger trained by the pipeline, then compared with the champion."""

    eval_gpus: OneDevice = "auto"
    metric: str = Field("auto", description="what makes a challenger better: auto (a sweep's: the validation "
                        "metric it optimized, val_loss: loss; else the objective's own: accuracy for "
                        "classification), loss (lower), accuracy (higher), or a metric of your objective (compared "
                        "by its mode)")

    def pipeline(self) -> dict:
        return self.model_dump(include=set(PipelineParams.model_fields))


class Sweep(BaseModel):
    """The sweep part of its flow's parameters: what is searched, how, and where it is kept."""

    script: Annotated[ScriptFile | None, SCRIPT] = Field(
        None, description="your torchrun script: each trial runs it with its values as arguments (see script_args); "
        "the training options (model, dataset, lr, ...) are then not used")
    script_args: ScriptArgs = []
    collect: Collect = []

    space: Annotated[str, AfterValidator(absolute), NO_SUCH_FILE] = Field(
        description="YAML file: parameter (or model_args.<key>) -> {type: float|int|choice, low, high, log, "
        "step, values}")
    trials: int = Field(20, ge=1, le=100_000, description="trials to finish (a resumed sweep counts its earlier ones)")
    parallel: Annotated[str | int, AfterValidator(check_parallel)] = Field(
        "auto", description="trials at a time: auto (as many as free cards allow, or CPU slots without a GPU) or N")
    gpus_per_trial: int = Field(1, ge=1, le=1024, description="cards per trial (each trial may be DDP)")
    pruner: Literal["median", "none"] = Field("median", description="stop trials whose epoch score is worse than "
                                              "the median of earlier trials at that epoch")
    optimize: str = Field("auto", description="the validation metric to optimize, e.g. val_loss (auto: the "
                          "objective's own monitor, val_accuracy for classification)")
    direction: Literal["auto", "minimize", "maximize"] = Field("auto", description="auto: the objective's mode")
    study: DottedName | None = Field(None, description="study name; the same name resumes it "
                                     "(default: sweep-<model>-<dataset>)")
    storage: Annotated[str | None, AfterValidator(check_storage)] = Field(
        None, description="SQLAlchemy URL of the study (default: optuna.db beside the SQLite tracking store, else "
        "the team stack's study database, else in the working folder)")
    sampler_seed: int | None = Field(None, ge=0, description="seed of the TPE sampler")


class SweepParams(Sweep, RetrainParams):
    """The sweep flow: a search over a run's parameters, each trial a run."""

    @model_validator(mode="after")
    def _trials_and_cards(self):
        """What the trials run and on which cards, checked before a server starts or a trial runs."""
        if self.nodes > 1 or self.nnodes > 1:
            raise ValueError("a sweep's trials each run on this machine; drop nodes/nnodes")
        if self.script:
            if self.optimize == "auto":
                raise SweepError("a script's sweep needs optimize=<the metric your script logs>, e.g. "
                                 "--optimize val_accuracy (with helper.report or mlflow.log_metric)")
            ScriptParams.model_validate(self.script_params({}))
        else:
            check_metric(self.objective, self.optimize)
        named = explicit_ids(self.gpus)
        cards = 0 if self.parallel == "auto" else int(self.parallel) * self.gpus_per_trial
        if named and cards > len(named):
            raise SweepError(f"parallel={self.parallel} trials x gpus_per_trial={self.gpus_per_trial} need {cards} "
                             f"cards but gpus={self.gpus} names {len(named)}; lower parallel or name more cards")
        return self

    def check_contents(self) -> None:
        """What is checked by reading the files the fields name (flows/calls.py `admit`, once they are there):
        the space file, and the study's storage not the tracking store's own file."""
        if self.storage:
            check_not_tracking_store(self.storage, self.tracking_uri)
        if self.script:
            check_script_space(read_space(self.space), self.script_args, self.space)
        else:
            check_space(read_space(self.space), self.pipeline(), self.space, PipelineParams.model_validate,
                        PipelineParams.model_fields)

    def script_params(self, values: dict) -> dict:
        """A script trial's parameters: the run's, with the trial's values in the script's arguments."""
        return self.model_dump(include=set(ScriptParams.model_fields)) | {
            "script_args": script_arguments(self.script_args, values)}


class EvaluateParams(BaseModel):
    """Loss and metrics of a registered version (or a checkpoint file) on one device."""

    registered_model: RegisteredModel = "gpuflow-model"
    version: Version = "champion"
    checkpoint: InputFile = Field(None, description="evaluate this checkpoint file instead of a registered version")
    gpus: OneDevice = "auto"
    split: Literal["val", "all"] = Field("val", description="the held-out split training used, or all samples")
    dataset: str | None = Field(None, description="evaluate on another dataset than the one trained on")
    data_root: str | None = Field(None, description="folder holding torchvision datasets")
    tracking_uri: TrackingUri = None


class InferParams(BaseModel):
    """Predictions of a registered version (or a checkpoint file) for a file of inputs, on one device."""

    inputs: Annotated[str, AfterValidator(absolute), NO_SUCH_FILE] = Field(
        description="N samples: a .pt file holding {'inputs': tensor or {name: tensor}}, a .npy array, "
        "or a .npz of named arrays")
    registered_model: RegisteredModel = "gpuflow-model"
    version: Version = "champion"
    checkpoint: InputFile = Field(None, description="use this checkpoint file instead of a registered version")
    gpus: OneDevice = "auto"
    output: str | None = Field(None, description="write the predictions JSON here (default: print it)")
    tracking_uri: TrackingUri = None
