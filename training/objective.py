"""What a batch is and what training minimises and reports: the objective.

Batches: a tensor (inputs, no target), a tuple/list `(inputs..., target)`, or a dict whose
`target`/`label`/`labels`/`y` entry is the target and whose other entries are the model's
keyword inputs. Outputs: a tensor, or a dict (classification reads its `logits`).

An objective is `classification` (cross-entropy, accuracy: the default), `model-loss`, or a reference to
user code (`--objective myproj.losses:Regression`), one of:
- a class or object with `loss(output, target)` -> scalar tensor, the batch mean; optionally
  `metrics(output, target)` -> {name: (sum, count)} per batch, an exact mean over every sample of
  every rank; `epoch_metrics(outputs, targets)` -> {name: float} on the whole validation set, on
  rank 0, each sample once in dataset order (AUC, F1); and `monitor` (a metric name, default
  "loss") with `mode` ("min" or "max"), what the retrain flow compares;
- a loss function or an `nn.Module` loss class (e.g. `torch.nn:MSELoss`): the loss alone.

The model is called with the batch's inputs alone. A model that computes its own loss from its
labels (Hugging Face style) gets the target when the objective sets `pass_target_as = "labels"`
(the keyword's name), and its loss reads the model's, e.g. `output["loss"]`. `model-loss` is that
objective built in, monitored as the validation loss.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from .config import BUILT_IN_OBJECTIVES, OBJECTIVES

TARGET_KEYS = ("target", "label", "labels", "y")
CLASSIFICATION, MODEL_LOSS = OBJECTIVES


# --- batches -------------------------------------------------------------------------


def split_batch(batch) -> tuple[Any, Any]:
    """(inputs, target) of a batch; target None for a bare tensor."""
    if isinstance(batch, torch.Tensor):
        return batch, None
    if isinstance(batch, dict):
        key = next((k for k in TARGET_KEYS if k in batch), None)
        return {k: v for k, v in batch.items() if k != key}, (batch[key] if key else None)
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return (batch[0] if len(batch) == 2 else tuple(batch[:-1])), batch[-1]
    if isinstance(batch, (tuple, list)) and len(batch) == 1:
        return batch[0], None
    raise TypeError(f"a batch must be a tensor, a tuple/list (inputs..., target) or a dict; got {type(batch).__name__}")


def call_model(model: nn.Module, inputs, **given):
    if isinstance(inputs, dict):
        return model(**inputs, **given)
    if isinstance(inputs, tuple):
        return model(*inputs, **given)
    return model(inputs, **given)


def apply(obj, fn):
    """fn on every tensor of nested tuples/lists/dicts."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: apply(v, fn) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(apply(v, fn) for v in obj)
    return obj


def first_tensor(obj) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    return next((t for t in map(first_tensor, values) if t is not None), None)


def batch_len(obj) -> int:
    t = first_tensor(obj)
    return len(t) if t is not None and t.dim() > 0 else 1


def shapes(obj) -> str:
    """'(2, 1, 28, 28) float32' or "{'x': (2, 3) float32}" for messages."""
    if isinstance(obj, torch.Tensor):
        return f"{tuple(obj.shape)} {str(obj.dtype).removeprefix('torch.')}"
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{k!r}: {shapes(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, (tuple, list)):
        return "(" + ", ".join(shapes(v) for v in obj) + ")"
    return type(obj).__name__


def concat(parts: list):
    """Batches of outputs or targets (tensors, or dicts of tensors) joined along the batch."""
    if parts and isinstance(parts[0], dict):
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    return torch.cat(parts) if parts and isinstance(parts[0], torch.Tensor) else parts


# --- objectives ------------------------------------------------------------------------


class Classification:
    """Cross-entropy and accuracy; the model's output is (N, classes) scores (or a dict's `logits`)."""

    monitor, mode = BUILT_IN_OBJECTIVES[CLASSIFICATION]

    @staticmethod
    def scores(output) -> torch.Tensor:
        return output["logits"] if isinstance(output, dict) else output

    def loss(self, output, target) -> torch.Tensor:
        return nn.functional.cross_entropy(self.scores(output).float(), target)

    def metrics(self, output, target) -> dict:
        return {"accuracy": ((self.scores(output).argmax(1) == target).sum(), len(target))}


class ModelLoss:
    """The model's own loss: the target is passed to the model as `labels`, the loss read back."""

    pass_target_as = "labels"

    @staticmethod
    def loss(output, target) -> torch.Tensor:
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"objective {MODEL_LOSS!r} reads the model's own loss, but its output has "
                            f"{'no' if loss is None else 'a non-tensor'} `loss` ({shapes(output)}); return "
                            "{'loss': ..., ...} (or an object with .loss) when the model is given labels")
        return loss.mean()  # DataParallel gathers one loss per replica


class Objective:
    """A user objective (or Classification) behind one interface; see the module's doc."""

    def __init__(self, spec):
        self.loss = spec.loss if hasattr(spec, "loss") else spec
        self.metrics = getattr(spec, "metrics", None)
        self.epoch_metrics = getattr(spec, "epoch_metrics", None)
        self.monitor = getattr(spec, "monitor", "loss")
        self.mode = getattr(spec, "mode", "min")
        self.is_classification = isinstance(spec, Classification)
        self.pass_target_as = getattr(spec, "pass_target_as", None)

    def forward(self, model: nn.Module, inputs, target):
        """The model's output for a batch: its inputs, and its target too when the objective asks."""
        given = {self.pass_target_as: target} if self.pass_target_as and target is not None else {}
        return call_model(model, inputs, **given)

    def batch_metrics(self, output, target) -> dict[str, tuple[torch.Tensor, int]]:
        return dict(self.metrics(output, target)) if self.metrics else {}


def load_objective(name: str, code_root: str | None = None) -> Objective:
    """The objective a config names: a built-in one, or a reference to user code."""
    if built_in := {CLASSIFICATION: Classification, MODEL_LOSS: ModelLoss}.get(name):
        return Objective(built_in())
    from .refs import CodeReferenceError, describe_error, resolve

    target = resolve(name, code_root, "objective")
    try:
        if inspect.isclass(target):
            target = target()  # a loss module (nn.MSELoss) or an objective class
    except Exception as e:
        raise CodeReferenceError(f"objective {name!r}: {target.__name__}() raised {describe_error(e)}") from None
    if not (hasattr(target, "loss") and callable(target.loss)) and not callable(target):
        raise CodeReferenceError(f"objective {name!r} is a {type(target).__name__}: name a loss function, an "
                                 "nn.Module loss class, or a class with loss(output, target)")
    return Objective(target)


class Totals:
    """One pass's loss and metric sums with their counts (on the batches' device: no sync per batch), and every
    output and target on the CPU when the objective has epoch_metrics."""

    def __init__(self, objective: Objective):
        self.objective = objective
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self.outputs: list = []
        self.targets: list = []

    def add(self, output, target, n: int) -> None:
        parts = {"loss": (self.objective.loss(output, target) * n, n), **self.objective.batch_metrics(output, target)}
        for name, (total, count) in parts.items():
            total = torch.as_tensor(total).detach().double()
            self.sums[name] = self.sums[name] + total if name in self.sums else total
            self.counts[name] = self.counts.get(name, 0) + int(count)
        if self.objective.epoch_metrics:
            self.outputs.append(apply(output, lambda t: t.float().cpu()))
            self.targets.append(apply(target, lambda t: t.cpu()))

    def means(self) -> dict[str, float]:
        """Each sum over its count, on this process's samples alone."""
        return {k: self.sums[k].item() / self.counts[k] for k in self.sums}
