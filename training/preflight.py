"""The user-code check the flow runs before any worker starts: one batch of two samples through the model and
the objective's loss, on the CPU, refusing what would fail later in every rank."""

from __future__ import annotations

import torch
from torch.utils.data import default_collate

from .builder import make_model
from .config import TrainConfig
from .data import load_data
from .datacache import check_sizes
from .errors import DatasetError, UserError
from .objective import Classification, load_objective, shapes, split_batch
from .refs import describe_error


@torch.no_grad()
def check_user_code(cfg: TrainConfig, world_size: int = 1) -> dict:
    """{"num_classes": the data's classes, else the model's output size, "output_shape"}; UserError on a problem."""
    bundle = load_data(cfg, fingerprint=False)
    check_sizes(f"dataset {cfg.dataset!r} has {len(bundle.train)} training and {len(bundle.val)} validation samples",
                len(bundle.train), len(bundle.val), world_size, "add samples to the sets your dataset returns")
    model, _ = make_model(cfg.model, bundle.num_classes, bundle.input_shape, cfg.model_args, cfg.code_root)
    objective = load_objective(cfg.objective, cfg.code_root)
    try:
        batch = default_collate([bundle.train[i] for i in range(min(2, len(bundle.train)))])
    except Exception as e:
        raise DatasetError(f"dataset {cfg.dataset!r}: two training samples cannot be batched: "
                           f"{describe_error(e)}; return tensors (or tuples/dicts of them) of one shape") from None
    inputs, target = split_batch(batch)
    what = f"model {cfg.model!r} on a batch of dataset {cfg.dataset!r}: inputs {shapes(inputs)}"
    if objective.pass_target_as and target is not None:
        what += f" and {objective.pass_target_as}={shapes(target)} (objective {cfg.objective!r} passes the target)"
    try:
        out = objective.forward(model.eval(), inputs, target)
    except Exception as e:
        raise UserError(f"{what} fails: {describe_error(e)}; make the model's input match the samples "
                        "(model_args, or the dataset's transform)") from None
    num_classes = (_check_classification(cfg, bundle, out, target, what) if objective.is_classification
                   else bundle.num_classes)
    try:
        loss = objective.loss(out, target)
    except Exception as e:
        raise UserError(f"objective {cfg.objective!r}: its loss on outputs {shapes(out)} and target "
                        f"{shapes(target)} raised {describe_error(e)}") from None
    if loss is None and not objective.pass_target_as:
        raise UserError(f"objective {cfg.objective!r}: its loss returned None on outputs {shapes(out)}; gpuflow "
                        "calls the model without the target (it goes to the objective), so a model that computes "
                        "its own loss from labels had none: use --objective model-loss (passes it as labels=), or "
                        "set pass_target_as = 'labels' on your objective")
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        got = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}"
        raise UserError(f"objective {cfg.objective!r}: its loss returned {got}; it must return a scalar tensor, "
                        "the batch mean (e.g. end with .mean())")
    try:
        for total, count in objective.batch_metrics(out, target).values():
            float(total), int(count)
    except Exception as e:
        raise UserError(f"objective {cfg.objective!r}: metrics must return {{name: (sum over the batch, count)}}; "
                        f"got an error reading them: {describe_error(e)}") from None
    return {"num_classes": num_classes, "output_shape": list(out.shape[1:]) if isinstance(out, torch.Tensor) else None}


def _check_classification(cfg: TrainConfig, bundle, out, target, what: str) -> int:
    scores = Classification.scores(out)
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or scores.shape[1] < 2:
        raise UserError(f"{what}: the output is {shapes(scores)}, but classification needs class scores (batch, "
                        "classes >= 2); return one score per class, or set objective to your own loss")
    classes = scores.shape[1]
    if bundle.num_classes and bundle.num_classes != classes:
        raise UserError(f"{what}: the dataset has {bundle.num_classes} classes but the model outputs {classes} scores; "
                        "set the model's output size (model_args, or take num_classes in its constructor)")
    if not isinstance(target, torch.Tensor) or target.is_floating_point():
        raise DatasetError(f"dataset {cfg.dataset!r}: classification needs integer class labels as targets; got "
                           f"{shapes(target)}; return (input, label) samples, or set objective to your own loss")
    every = _all_labels(bundle.train)
    labels = every if every is not None else target  # else the batch's: decoding every sample is training's job
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= classes:
        raise DatasetError(f"dataset {cfg.dataset!r}: labels run {low}..{high}, outside the model's {classes} "
                           f"outputs (0..{classes - 1}); fix the labels or the model's output size")
    if every is not None and not bundle.num_classes and classes > high + 1:
        raise UserError(f"{what}: the model outputs {classes} class scores but the labels run {low}..{high} "
                        f"({high + 1} classes): it would train, and be registered, with {classes - high - 1} "
                        f"scores no label uses; give it {high + 1} outputs (e.g. model_args "
                        f"'{{\"num_classes\": {high + 1}}}' for torchvision models), or have the dataset factory "
                        "return num_classes")
    return classes


def _all_labels(dataset) -> torch.Tensor | None:
    """Every label, when the dataset holds them apart (torchvision's `targets`, a TensorDataset); else None."""
    if getattr(dataset, "targets", None) is not None:
        return torch.as_tensor(dataset.targets)
    if isinstance(dataset, torch.utils.data.TensorDataset) and len(dataset.tensors) >= 2:
        return dataset.tensors[-1]
    return None
