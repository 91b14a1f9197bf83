"""Typed training config: the flow validates it and writes it to JSON; the worker reads that JSON and stores it in
every checkpoint."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from . import refs
from .errors import UserError
from .files import write_json_atomic

MODELS = ("mlp", "cnn", "resnet18")
# each built-in objective (training/objective.py): its (monitor, mode) and the metrics its epochs report
BUILT_IN_OBJECTIVES = {"classification": ("accuracy", "max"), "model-loss": ("loss", "min")}
OBJECTIVES = tuple(BUILT_IN_OBJECTIVES)
KNOWN_METRICS = {"classification": {"val_loss", "val_accuracy", "train_loss"}, "model-loss": {"val_loss", "train_loss"}}
BUILTIN_MODELS_MODULE = "gpuflow.training.models"  # where the built-ins live (torch-free name for the flow)
BUILTIN_DATASETS = ("digits", "synthetic", "mnist", "fashion-mnist", "cifar10")
Precision = Literal["fp32", "bf16", "fp16"]
# the device plan decides it (tasks/devices/assign.py); the worker's config and device pick assert it
FP16_NEEDS_CUDA = "precision 'fp16' needs CUDA and this run is on CPU; use 'bf16' or 'fp32'"
Strategy = Literal["single", "dp", "ddp"]


@dataclass(frozen=True)
class Exists:
    """A path field's mark: it must name a file when the job is entered. Validation reads no file (it only makes
    the path absolute); flows/calls.py `admit` checks every marked field. The refusals take {path} (absolute)
    and {given} (as typed); `unless` are values that are not paths."""

    missing: str
    folder: str | None = None
    unless: tuple[str, ...] = ()

    def refusal(self, path: str, given: Any) -> str | None:
        """Why `path` cannot be read as this field's file; None when it can."""
        if path in self.unless:
            return None
        try:
            if Path(path).is_file():
                return None
            folder = self.folder and Path(path).is_dir()
        except OSError:  # a name too long for the filesystem, say
            folder = False
        return (self.folder if folder else self.missing).format(path=path, given=given)


def absolute(v: str) -> str:
    """A path as meant where the user typed it (workers and children run elsewhere)."""
    return str(Path(v).expanduser().resolve())


MAX_SEED = 2**32 - 1  # NumPy's seeds are 32-bit
MAX_EPOCHS = 100_000  # beyond any real job; absurd counts broke the Prefect UI's run list
MIN_SIDE = 28  # small images (8x8 digits) are upsampled to this side


def input_shape_for(model: str, native: tuple[int, ...]) -> tuple[int, int, int]:
    """The (C, H, W) the model takes, given the dataset's native image shape (torch-free)."""
    if model == "mlp":
        return (1, 28, 28)
    c, h, w = native
    side = max(MIN_SIDE, h, w)
    return (3 if model == "resnet18" else c, side, side)


def val_count(n: int, val_fraction: float) -> int:
    """Validation samples when n are split (training.data.split_indices; torch-free for the flow)."""
    return max(1, int(round(n * val_fraction)))


class Training(BaseModel):
    """The training part of a flow's parameters, as the user sets them (flows/params.py adds the other parts)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)

    model: str = Field("mlp", description=f"one of {', '.join(MODELS)}, or your own nn.Module class or "
                       "factory: package.module:Name (imported from the folder gpuflow runs in) or file.py:Name")
    model_args: dict[str, Any] = Field(
        {}, description="JSON object of keyword arguments for your model (num_classes and "
        "input_shape are passed too when its signature names them)")
    dataset: str = Field(
        "digits",
        description="digits (ships with scikit-learn, offline), synthetic, mnist, "
        "fashion-mnist, cifar10, imagefolder:<path>, or your own: package.module:factory or "
        "file.py:factory, returning (train, val) datasets",
    )
    objective: str = Field(
        "classification", description="classification (cross-entropy, accuracy), model-loss (the model's own "
        "loss, given the target as labels=), or your own loss/metrics: package.module:Name or file.py:Name "
        "(see docs/your-code.md)")
    data_root: str = Field("data", validate_default=True, description="folder holding torchvision datasets")
    download: bool = Field(False, description="download torchvision datasets if missing")
    val_fraction: float = Field(0.2, gt=0, lt=1, description="share held out for validation")
    split_seed: int = Field(0, ge=0, le=MAX_SEED, description="seed of the train/validation split")
    synthetic_size: int = Field(4096, ge=2, le=10_000_000, description="samples in the synthetic dataset")
    synthetic_side: int = Field(28, ge=8, le=512, description="image side of the synthetic dataset")
    epochs: int = Field(3, ge=1, le=MAX_EPOCHS, description="epochs to train")
    batch_size: int = Field(64, ge=1, le=1_000_000, description="global batch size, split across devices")
    lr: float = Field(1e-3, gt=0, description="learning rate")
    optimizer: Literal["adam", "sgd"] = Field("adam", description="adam, or sgd with momentum")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum")
    grad_clip: float = Field(0.0, ge=0, description="max grad norm; 0 disables clipping")
    precision: Precision = Field("fp32", description="bf16/fp16: autocast mixed precision (fp16 needs CUDA; bf16 "
                                 "with DataParallel on one GPU only: use ddp)")
    seed: int = Field(42, ge=0, le=MAX_SEED, description="seed of Python, NumPy and torch (every device)")
    deterministic: bool = Field(False, description="cudnn.deterministic + deterministic algorithms")
    cudnn_benchmark: bool = Field(False, description="let cuDNN pick the fastest kernels (off with deterministic)")
    num_workers: int = Field(0, ge=0, le=256, description="DataLoader worker processes")
    resume: Annotated[str, Exists("checkpoint '{path}' does not exist; check the resume path (or use auto or never)",
                                  unless=("auto", "never"))] = Field(
        "auto", validate_default=True,
        description="auto: a restart of this run continues from its own newest checkpoint; never: start "
        "fresh; or a checkpoint file to start from",
    )
    max_steps_per_epoch: int = Field(0, ge=0, le=100_000_000, description="cap on steps per epoch; 0 = no cap")
    keep_checkpoints: int = Field(2, ge=1, le=1_000_000, description="epoch checkpoints kept in the run's folder: "
                                  "the newest N, plus the best by the objective's monitored metric")

    @field_validator("model", "objective")
    @classmethod
    def _builtin_or_reference(cls, v: str, info) -> str:
        if refs.is_reference(v):
            return refs.normalize(v)
        builtins = MODELS if info.field_name == "model" else OBJECTIVES
        if v not in builtins:
            raise ValueError(f"unknown {info.field_name} {v!r}; choose one of {', '.join(builtins)}, or name your "
                             "own as package.module:Name or file.py:Name")
        return v

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, v: str) -> str:
        if refs.is_reference(v):
            return refs.normalize(v)
        if v.startswith("imagefolder:"):
            if not (folder := v.removeprefix("imagefolder:")):
                raise ValueError("dataset 'imagefolder:' needs a path, e.g. imagefolder:/data/pets")
            return "imagefolder:" + absolute(folder)
        if v not in BUILTIN_DATASETS:
            raise ValueError(
                f"unknown dataset {v!r}; choose one of {', '.join(BUILTIN_DATASETS)}, "
                "imagefolder:<path>, or your own factory as package.module:datasets or file.py:datasets"
            )
        return v

    @field_validator("data_root", "resume")
    @classmethod
    def _absolute(cls, v: str) -> str:
        """As meant where the user typed them; whether a resume file is there is checked when the job is entered."""
        return v if v in ("auto", "never") else absolute(v)

    @model_validator(mode="after")
    def _args_for_own_model(self) -> "Training":
        if self.model_args and not refs.is_reference(self.model):
            raise ValueError(f"model_args apply to a model of your own (package.module:Class); the built-in "
                             f"{self.model!r} takes none: drop model_args")
        return self

    @property
    def user_code(self) -> bool:
        """Whether the model, the data or the objective is the user's own code."""
        return any(refs.is_reference(v) for v in (self.model, self.dataset, self.objective))


DistTimeout = Annotated[float, Field(ge=10, le=86_400, description="collective/rendezvous timeout")]


class TrainConfig(Training):
    """Everything the worker needs: the user's training fields plus what the flow decides (flows/prepared.py
    worker_config), nothing about the host."""

    strategy: Strategy = Field("single", description="single device, nn.DataParallel, or DDP under torchrun")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto uses CUDA when the child sees a GPU")
    device_ids: list[int] | None = Field(None, description="logical DataParallel device ids (default: all visible)")
    dist_timeout_s: DistTimeout = 300.0
    checkpoint_dir: str = Field("checkpoints", description="where checkpoints are written")
    checkpoint_each_epoch: bool = Field(True, description="a checkpoint at every epoch's end; else after the last "
                                        "alone (a sweep's trial: it never resumes, and registering needs its weights)")
    data_cache: str | None = Field(
        None, description="prepared dataset file written by the flow's data step (training/datacache.py); "
        "workers read it instead of the source")
    code_root: str | None = Field(
        None, description="folder that module references import from (set by the flow: where it runs)")
    num_classes: int | None = Field(
        None, ge=1, description="the model's output size, when the dataset does not say (set by the flow's preflight)")

    @model_validator(mode="after")
    def _consistent(self) -> "TrainConfig":
        if self.precision == "fp16" and self.device == "cpu":
            raise ValueError(FP16_NEEDS_CUDA)
        if self.device_ids is not None and self.strategy != "dp":
            raise ValueError("device_ids applies to strategy 'dp' only; leave it unset")
        return self

    # --- JSON round trip -------------------------------------------------------------
    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    def to_json(self, path: str | Path) -> Path:
        return write_json_atomic(path, self.to_dict())

    @classmethod
    def from_json(cls, path: str | Path) -> "TrainConfig":
        path = Path(path)
        if not path.is_file():
            raise UserError(f"config file {str(path)!r} does not exist; pass the path of a "
                            "TrainConfig JSON file (fields: training/config.py)")
        return cls.model_validate(json.loads(path.read_text()))


def batch_split(batch: int, devices: int, what: str, processes: int | None = None) -> str | None:
    """Why a global batch does not give each of `devices` a sample or split evenly over `processes`; else None."""
    if batch < devices:
        return f"global batch_size {batch} is smaller than the {devices} {what}; use batch_size >= {devices} or fewer devices"
    if processes and batch % processes:
        return (f"global batch_size {batch} does not split evenly over {processes} processes; use a multiple of "
                f"{processes}, e.g. {batch - batch % processes or processes}")
    return None
