"""The registered model's input example and output spec, from a trained worker's model (rank 0)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch.utils.data import default_collate

from .checkpoint import unwrap
from .files import atomic_write
from .objective import apply, call_model, split_batch


@torch.no_grad()
def model_example(model, val, device, n: int = 2) -> tuple:
    """(the first `n` validation inputs as an array or a dict of arrays, the model's outputs on them as
    [{"name", "dtype", "shape"}], a tuple's first tensor with its "element" and "container"); (None, None) for
    positional tuple inputs. Floats become float32."""
    inputs, _ = split_batch(default_collate([val[i] for i in range(min(n, len(val)))]))
    if not (isinstance(inputs, torch.Tensor) or
            isinstance(inputs, dict) and all(isinstance(v, torch.Tensor) for v in inputs.values())):
        return None, None
    model = unwrap(model)
    was_training = model.training
    model.eval()
    out = call_model(model, apply(inputs, lambda t: t.to(device)))
    model.train(was_training)
    array = (lambda t: t.float().cpu().numpy() if t.is_floating_point() else t.cpu().numpy())
    example = array(inputs) if isinstance(inputs, torch.Tensor) else {k: array(v) for k, v in inputs.items()}
    spec = (lambda name, t: {"name": name, "dtype": str(array(t[:0]).dtype), "shape": list(t.shape[1:])})
    if isinstance(out, Mapping):  # a dict or a ModelOutput: its per-sample tensors (not a None loss)
        named = [spec(k, v) for k, v in out.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
        return example, named or None
    if isinstance(out, (tuple, list)):  # the registered model predicts its first tensor (registered_model.py)
        at = next((i for i, v in enumerate(out) if isinstance(v, torch.Tensor)), None)
        if at is None or out[at].dim() == 0:
            return example, None
        return example, [spec(None, out[at]) | {"element": at, "container": type(out).__name__}]
    return example, ([spec(None, out)] if isinstance(out, torch.Tensor) and out.dim() > 0 else None)


def save_example(stem: Path, example) -> Path:
    """An array as `<stem>.npy`, or named arrays as `<stem>.npz`, written atomically."""
    import numpy as np

    named = isinstance(example, dict)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a file object: numpy adds no suffix of its own
            np.savez(f, **example) if named else np.save(f, example)

    return atomic_write(stem.with_suffix(".npz" if named else ".npy"), write)
