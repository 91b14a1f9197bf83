"""Every parameter of gpuflow's flows, declared once: type, default, bounds and help.

The flows' signatures (so the Prefect UI form and the deployments), the `gpuflow` CLI
options and the validation all derive from the models here; the worker's own fields come
from `TrainConfig` (gpuflow/training/config.py), which `PipelineParams` extends. Parameters
are flat on purpose: `-p epochs=3` and `--epochs 3` name fields directly.
"""

from __future__ import annotations

import inspect
import os
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

import annotated_types
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model, model_validator

from gpuflow.tasks.assign import GPUS_HELP, DevicePlan, one_device, parse_gpus
from gpuflow.training import TrainConfig
from gpuflow.training.contract import RunFolder
from gpuflow.training.errors import UserError

from .calls import entered

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._-]{0,99}")
URI_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql", "http", "https", "file", "databricks")


def check_name(v: str) -> str:
    """Names become folders, registry queries and UI links: a safe alphabet only."""
    if not NAME.fullmatch(v) or ".." in v:
        raise ValueError("not a usable name: use up to 100 letters, digits, spaces, '.', '_' "
                         "or '-', starting with a letter or digit (no '/', quotes or '..')")
    return v


def check_tracking_uri(v: str | None) -> str:
    """The store's URI; unset, resolved here once for the whole run (MLFLOW_TRACKING_URI, else
    mlflow.db in the working folder)."""
    if v is None:
        from gpuflow.tasks.store import default_tracking_uri

        return default_tracking_uri()
    scheme = v.split(":", 1)[0].split("+", 1)[0] if ":" in v else ""
    if scheme not in URI_SCHEMES:
        hint = f"sqlite:///{os.path.abspath(v)}" if v.endswith(".db") else "sqlite:///<path>/mlflow.db"
        raise ValueError(f"not an MLflow tracking URI; use e.g. {hint}, "
                         "postgresql://user@host/db or http://host:5000")
    return v


def check_endpoint(v: str | None) -> str | None:
    host, _, port = (v or "").rpartition(":")
    if v is not None and not (host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError("not host:port; use node 0's address and a free port, e.g. 10.0.0.5:29500")
    return v


def check_cores(name: str, value: int) -> None:
    cores = os.cpu_count() or 1
    if value > cores:
        raise ValueError(f"{name}={value} is more than the {cores} CPUs of this host; use at most {cores} (0 = auto)")


# Parameters several flows share, declared here once.
Gpus = Annotated[str, AfterValidator(parse_gpus), Field(description=GPUS_HELP)]
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


def check_file(v: str | None) -> str | None:
    """A file the command reads, made absolute (the evaluation child runs elsewhere)."""
    if v is None:
        return v
    path = Path(v).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"no such file ({path}); check the path")
    return str(path)


Version = Annotated[str | int, AfterValidator(check_version),
                    Field(description="a registered version number, or 'champion'")]
OneDevice = Annotated[str, AfterValidator(check_one_device),
                      Field(description="the one device: auto, cpu, 1 (the freest GPU), or a physical id like 3,")]
InputFile = Annotated[str | None, AfterValidator(check_file)]

# Worker fields the flow sets from the device plan and the run's folder, never the user.
PLAN_OWNED = ("device", "device_ids", "checkpoint_dir", "data_cache", "code_root", "num_classes")
# Where a run is recorded, not how it trains: left out of the run's params.
RECORD_KEEPING = ("experiment", "run_name", "registered_model", "tracking_uri", "runs_dir", "node_rank",
                  "rdzv_endpoint")


class PipelineParams(TrainConfig):
    """The train pipeline's parameters: the worker's config plus devices, launch and tracking."""

    strategy: Literal["auto", "single", "dp", "ddp"] = Field(  # type: ignore[assignment]
        "auto", description="auto: ddp for several devices (gloo on CPU), single for one")
    gpus: Gpus = "auto"
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="DDP backend; auto: nccl on GPUs, gloo on CPU")
    min_free_mb: int = Field(0, ge=0, le=10_000_000, description="refuse/skip GPUs with less free memory")
    skip_busy: bool = Field(True, description="skip GPUs already running other processes")
    cpu_processes: int = Field(0, ge=0, description="DDP processes on a CPU-only host (0 = auto; "
                               "at most the host's CPU count)")
    max_restarts: int = Field(1, ge=0, le=100, description="torchrun elastic restarts after a worker dies")
    launch_retries: int = Field(0, ge=0, le=10, description="Prefect retries of the launch (resume from checkpoint)")
    nnodes: int = Field(1, ge=1, le=4096, description="machines in a multi-node DDP job")
    node_rank: int = Field(0, ge=0, description="this machine's rank; only node 0 owns the MLflow run")
    rdzv_endpoint: Annotated[str | None, AfterValidator(check_endpoint)] = Field(
        None, description="host:port of node 0's rendezvous (multi-node)")
    rdzv_timeout_s: int = Field(300, ge=10, le=86_400, description="fail when not every node arrives in time")
    experiment: Name = Field("gpuflow", description="MLflow experiment name")
    run_name: Name | None = Field(None, description="the MLflow and Prefect run name; unset, it is "
                                  "<model>-<dataset>-<strategy>-x<world size>-<unique suffix>")
    registered_model: RegisteredModel = "gpuflow-model"
    tracking_uri: TrackingUri = None
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
        if self.nnodes > 1:
            self.strategy = "ddp"  # one process per node is still DDP
        return self

    @model_validator(mode="after")
    def _fits_this_host(self) -> "PipelineParams":
        for name in ("cpu_processes", "num_workers"):
            check_cores(name, getattr(self, name))
        if self.dataset == "synthetic":
            need = self.synthetic_size * self.synthetic_side ** 2 * 4  # float32, one channel, per process
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            if need > ram // 2:
                raise ValueError(f"synthetic_size={self.synthetic_size} at synthetic_side={self.synthetic_side} "
                                 f"needs {need / 2**30:.1f} GiB per process, more than half of this host's "
                                 f"{ram / 2**30:.0f} GiB; lower synthetic_size or synthetic_side")
        return self

    def train_config(self, plan: DevicePlan | None = None, workdir: Path | None = None,
                     data_cache: str | None = None, num_classes: int | None = None) -> TrainConfig:
        """The worker's config; with a plan, strategy and devices come from it. References to
        the user's code import from the folder the flow runs in."""
        fields = {k: v for k, v in self.model_dump().items() if k in TrainConfig.model_fields}
        fields["code_root"] = str(Path.cwd())
        fields["num_classes"] = num_classes
        fields["strategy"] = plan.strategy if plan else "single"
        if plan:
            fields["device"] = plan.device
            fields["device_ids"] = plan.logical_ids if plan.strategy == "dp" and plan.device == "cuda" else None
        if workdir:
            fields["checkpoint_dir"] = str(RunFolder(workdir).checkpoints)
        fields["data_cache"] = data_cache
        return TrainConfig(**fields)

    def world_size(self, plan: DevicePlan) -> int:
        """Processes in the whole job: the plan's per node, times the nodes."""
        return plan.nproc_per_node * self.nnodes

    def run_params(self, config: TrainConfig, plan: DevicePlan) -> dict:
        """The MLflow run's params: the worker's config as it ran, plus the launch's settings."""
        launch = {k: v for k, v in self.model_dump(mode="json").items()
                  if k not in TrainConfig.model_fields and k not in RECORD_KEEPING}
        return {**launch, "backend": plan.backend, "nproc_per_node": plan.nproc_per_node,
                "world_size": self.world_size(plan), **config.to_dict()}


def check_script(v: str) -> str:
    path = Path(v).expanduser().resolve()
    if path.is_dir():
        raise ValueError(f"{path} is a directory; give the path of your training script in it, e.g. "
                         f"{Path(v) / 'train.py'}")
    if not path.is_file():
        raise ValueError(f"no such file ({path}); give the path of your training script, e.g. train_ddp.py")
    if path.suffix != ".py":
        raise ValueError(f"{path.name} is not a Python file; torchrun runs a .py script")
    return str(path)


def check_collect(patterns: list[str]) -> list[str]:
    """Glob patterns stay inside the working folder: relative, no '..' (a '**/..' climbs out,
    since '**' also matches no folder at all). What each pattern matches is checked again, file
    by file, by its real path when the outputs are logged (tasks/scriptout.py)."""
    for pattern in patterns:
        path = Path(pattern)
        if not pattern.strip() or path.is_absolute() or pattern.startswith("~") or ".." in path.parts:
            raise ValueError(f"collect pattern {pattern[:200]!r} must be a glob relative to the working folder "
                             "that stays inside it (no leading '/' or '~', no '..'), e.g. 'snapshot.pt' or "
                             "'checkpoints/*.pt'")
    return patterns


# The train pipeline's device, launch and tracking fields, shared as they are declared there.
SCRIPT_SHARED = ("gpus", "backend", "min_free_mb", "skip_busy", "cpu_processes", "max_restarts", "dist_timeout_s",
                 "experiment", "run_name", "registered_model", "tracking_uri", "runs_dir")
_ScriptBase = create_model("_ScriptBase", __config__=ConfigDict(extra="forbid"),
                           **{k: (PipelineParams.model_fields[k].annotation, PipelineParams.model_fields[k])
                              for k in SCRIPT_SHARED})


class ScriptParams(_ScriptBase):
    """The train-script flow: your own torchrun script on the assigned devices, in one MLflow run."""

    script: Annotated[str, AfterValidator(check_script)] = Field(
        description="your training script (.py), run by torchrun from the folder gpuflow runs in")
    script_args: list[str] = Field([], description="the script's own arguments (on the command line: "
                                   "everything after --)", json_schema_extra={"cli": "rest"})
    collect: Annotated[list[str], AfterValidator(check_collect)] = Field([], description=(
        "glob patterns, relative to the working folder and staying inside it, of files the script writes "
        "outside GPUFLOW_OUTPUT_DIR to log as artifacts (e.g. [\"snapshot.pt\"]); the newest state dict "
        "among them is the run's checkpoint"))
    strategy: Literal["auto", "single", "ddp"] = Field(
        "auto", description="auto: one process per device; the script wraps its model itself (DDP or none)")

    # one node; the launch reads these (tasks/launch.py LaunchRequest)
    nnodes: typing.ClassVar[int] = 1
    node_rank: typing.ClassVar[int] = 0
    rdzv_endpoint: typing.ClassVar[str | None] = None
    rdzv_timeout_s: typing.ClassVar[int] = 300

    @model_validator(mode="after")
    def _fits_this_host(self) -> "ScriptParams":
        check_cores("cpu_processes", self.cpu_processes)
        return self

    def run_params(self, plan: DevicePlan) -> dict:
        """gpuflow's own params for the run, under `gpuflow.` so they never collide with the script's."""
        mine = self.model_dump(mode="json", exclude=set(RECORD_KEEPING))
        mine |= {"backend": plan.backend, "nproc_per_node": plan.nproc_per_node, "world_size": plan.nproc_per_node,
                 "device": plan.device}
        return {f"gpuflow.{k}": v for k, v in mine.items()}


class RetrainParams(PipelineParams):
    """The retrain flow: a challenger trained by the pipeline, then compared with the champion."""

    eval_gpus: OneDevice = "auto"
    metric: str = Field("auto", description="what makes a challenger better: auto (the objective's own: "
                        "accuracy for classification), loss (lower), accuracy (higher), or a metric of your "
                        "objective (compared by its mode)")

    def pipeline(self) -> dict:
        return self.model_dump(include=set(user_fields(PipelineParams)))


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

    inputs: Annotated[str, AfterValidator(check_file)] = Field(
        description="N samples: a .pt file holding {'inputs': tensor or {name: tensor}}, a .npy array, "
        "or a .npz of named arrays")
    registered_model: RegisteredModel = "gpuflow-model"
    version: Version = "champion"
    checkpoint: InputFile = Field(None, description="use this checkpoint file instead of a registered version")
    gpus: OneDevice = "auto"
    output: str | None = Field(None, description="write the predictions JSON here (default: print it)")
    tracking_uri: TrackingUri = None


def user_fields(model: type[BaseModel]) -> dict:
    """Fields a user sets (flow parameters, CLI options): all but the plan-owned ones."""
    return {k: f for k, f in model.model_fields.items() if k not in PLAN_OWNED}


def _schema_type(field) -> Any:
    """The field's type with its bounds, for the Prefect form (validation stays with the model)."""
    bounds = [m for m in field.metadata if isinstance(m, annotated_types.BaseMetadata)]
    return Annotated[(field.annotation, *bounds)] if bounds else field.annotation


def flat_parameters(model: type[BaseModel]) -> Callable[[Callable[[Any], Any]], Callable[..., Any]]:
    """Give `fn(params: model)` the flat keyword signature of `model`'s user fields.

    Prefect builds a flow's parameters, its UI form and its deployments' defaults from the
    function's signature and docstring; this sets both from the one declaration, and the
    call validates the values once, by building `model` (flows/calls.py: one line per bad value).
    """
    fields = user_fields(model)

    def wrap(fn: Callable[[Any], Any]) -> Callable[..., Any]:
        def flat(**values):
            return fn(entered(model, values))

        flat.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                               default=inspect.Parameter.empty if f.is_required() else f.default,
                               annotation=_schema_type(f)) for name, f in fields.items()],
            return_annotation=inspect.signature(fn).return_annotation)
        args = "\n".join(f"    {name}: {(f.description or name).strip()}" for name, f in fields.items())
        flat.__doc__ = f"{inspect.getdoc(fn) or ''}\n\nArgs:\n{args}\n"
        flat.__name__, flat.__qualname__, flat.__module__ = fn.__name__, fn.__qualname__, fn.__module__
        return flat

    return wrap


def origin_is(annotation, kind: type) -> bool:
    """Whether a (possibly optional) annotation is `kind` or a parametrised `kind[...]`."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return any(a is kind or typing.get_origin(a) is kind for a in (annotation, *args))
