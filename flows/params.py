"""Every parameter of gpuflow's flows, declared once (type, default, bounds, help) in parts beside the code that
reads them; the flows' signatures, the CLI options and the validation derive from these models. Parameters are
flat on purpose: `-p epochs=3` and `--epochs 3` name fields directly.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from gpuflow.tasks.devices.assign import DevicePlan, Devices, explicit_ids, one_device
from gpuflow.tasks.data import DatasetInfo
from gpuflow.tasks.launch import SCRIPT, Launch, Nodes, Placement, ScriptArgs, ScriptFile
from gpuflow.tasks.scriptout import Collect
from gpuflow.training.config import Exists, TrainConfig, Training, absolute
from gpuflow.training.contract import RunFolder
from gpuflow.training.errors import UserError
from gpuflow.training.policy import check_not_tracking_store

from .space import SweepError, check_metric, check_script_space, check_space, read_space, script_arguments

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._-]{0,99}")
URI_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql", "http", "https", "file", "databricks")


def check_name(v: str) -> str:
    """Names become folders, registry queries and UI links: a safe alphabet only."""
    if not NAME.fullmatch(v) or ".." in v:
        raise ValueError("not a usable name: use up to 100 letters, digits, spaces, '.', '_' "
                         "or '-', starting with a letter or digit (no '/', quotes or '..')")
    return v


def check_tracking_uri(v: str | None) -> str:
    """The store's URI; unset, resolved once here for the whole run (MLFLOW_TRACKING_URI, else ./mlflow.db)."""
    if v is None:
        from gpuflow.tasks.tracking.store import default_tracking_uri

        return default_tracking_uri()
    scheme = v.split(":", 1)[0].split("+", 1)[0] if ":" in v else ""
    if scheme not in URI_SCHEMES:
        hint = f"sqlite:///{os.path.abspath(v)}" if v.endswith(".db") else "sqlite:///<path>/mlflow.db"
        raise ValueError(f"not an MLflow tracking URI; use e.g. {hint}, "
                         "postgresql://user@host/db or http://host:5000")
    return v


# Parameters several flows share, declared here once.
TrackingUri = Annotated[str | None, AfterValidator(check_tracking_uri),
                        Field(description="MLflow URI (default: MLFLOW_TRACKING_URI, else "
                              "sqlite:///<working directory>/mlflow.db)", validate_default=True)]
Name = Annotated[str, AfterValidator(check_name)]
RegisteredModel = Annotated[Name, Field(description="Model Registry name")]
def check_version(v: str | int) -> str:
    """A version number (1 or "1": the Prefect form and `-p version=1` send a number) or 'champion'."""
    v = str(v)
    if not (v.isdigit() and int(v) > 0) and v != "champion":
        raise ValueError("not a version: use a registered version number (1, 2, ...) or 'champion'")
    return v


def check_one_device(v: str) -> str:
    try:
        return one_device(v)
    except UserError as e:
        raise ValueError(str(e)) from None


NO_SUCH_FILE = Exists("no such file ({path}); check the path")


Version = Annotated[str | int, AfterValidator(check_version),
                    Field(description="a registered version number, or 'champion'")]
OneDevice = Annotated[str, AfterValidator(check_one_device),
                      Field(description="the one device: auto, cpu, 1 (the freest GPU), or a physical id like 3,")]
InputFile = Annotated[str | None, AfterValidator(lambda v: v and absolute(v)), NO_SUCH_FILE]

class Tracking(BaseModel):
    """The tracking part of a flow's parameters: where and under which names a run is recorded, not
    how it trains (so none of it is among the run's params)."""

    experiment: Name = Field("gpuflow", description="MLflow experiment name")
    run_name: Name | None = Field(None, description="the MLflow and Prefect run name; unset, it is "
                                  "<model>-<dataset>-<strategy>-x<world size>-<unique suffix>")
    registered_model: RegisteredModel = "gpuflow-model"
    tracking_uri: TrackingUri = None
    runs_dir: str = Field("runs", description="folder for per-run configs, checkpoints and logs")


class PipelineParams(Tracking, Nodes, Launch, Devices, Training):
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


def worker_config(params: PipelineParams, plan: DevicePlan, data: DatasetInfo | None = None,
                  folder: RunFolder | None = None) -> TrainConfig:
    """The worker's config from the request, the plan, the prepared data and the run's folder (none yet for the
    data step and the preflight); the user's code imports from the folder the flow runs in."""
    return TrainConfig(
        **params.model_dump(include=set(Training.model_fields)), dist_timeout_s=params.dist_timeout_s,
        strategy=plan.strategy, device=plan.device,
        device_ids=plan.logical_ids if plan.strategy == "dp" and plan.device == "cuda" else None,
        code_root=str(Path.cwd()), data_cache=data and data.cache, num_classes=data and data.num_classes,
        **({"checkpoint_dir": str(folder.checkpoints)} if folder else {}))


# Where a run is recorded, not how it trains: left out of the run's params.
RECORD_KEEPING = (*Tracking.model_fields, "node_rank", "rdzv_endpoint", "node_pool", "job")


class ScriptParams(Tracking, Placement, Launch, Devices):
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
    metric: str = Field("auto", description="what makes a challenger better: auto (the objective's own: "
                        "accuracy for classification), loss (lower), accuracy (higher), or a metric of your "
                        "objective (compared by its mode)")

    def pipeline(self) -> dict:
        return self.model_dump(include=set(PipelineParams.model_fields))


def check_parallel(v: str | int) -> str:
    """auto or a count; a number as the Prefect form and `-p parallel=2` send it, or as text."""
    v = str(v).strip()
    if v != "auto" and not (v.isdigit() and int(v) >= 1):
        raise ValueError(f"parallel={v!r}: use auto or a number of trials at a time, like 2")
    return v


class Sweep(BaseModel):
    """The sweep part of its flow's parameters: what is searched, how, and where it is kept."""

    script: Annotated[ScriptFile | None, SCRIPT] = Field(None, description="your torchrun script: each trial runs it with its "
                                      "values as arguments (see script_args); the training options (model, "
                                      "dataset, lr, ...) are then not used")
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
    study: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$",
                              description="study name; the same name resumes it (default: sweep-<model>-<dataset>)")
    storage: str | None = Field(None, description="SQLAlchemy URL of the study (default: optuna.db beside the "
                                "SQLite tracking store, else in the working folder)")
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
        if named and self.parallel != "auto" and int(self.parallel) * self.gpus_per_trial > len(named):
            raise SweepError(f"parallel={self.parallel} trials x gpus_per_trial={self.gpus_per_trial} need "
                             f"{int(self.parallel) * self.gpus_per_trial} cards but gpus={self.gpus} names "
                             f"{len(named)}; lower parallel or name more cards")
        return self

    def check_contents(self) -> None:
        """What is checked by reading the files the fields name (flows/calls.py `validated`, once they are there):
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
