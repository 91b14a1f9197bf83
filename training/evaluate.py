"""Evaluate or apply a checkpoint on one device, reporting through a JSON file.

    python -m gpuflow.training.evaluate --checkpoint CK --result OUT.json [--dataset D ...]
    python -m gpuflow.training.evaluate --checkpoint CK --result OUT.json --inputs X.pt

Loads only tensors (weights_only=True) and rebuilds the plain model from the config stored
in the checkpoint. Without --inputs: loss and the objective's metrics (accuracy for
classification) on the dataset's validation split (the same deterministic split training
held out) or on all of it. With --inputs (a tensor file, N samples of the model's input
shape): the predicted class and class probabilities of each, or the model's raw outputs
for an objective of your own. Run it in a child whose CUDA_VISIBLE_DEVICES holds the card
to use: inside, that card is cuda:0.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys

import torch

from .cardlock import hold_card_locks
from .checkpoint import CheckpointError, load_file, load_model_state
from .config import TrainConfig
from .builder import build_model
from .data import TensorData, load_data
from .errors import UserError
from .files import write_json_atomic
from .objective import Totals, apply, batch_len, call_model, concat, load_objective, split_batch


def _device(device: str) -> torch.device:
    use_cuda = device != "cpu" and torch.cuda.is_available()
    return torch.device("cuda", 0) if use_cuda else torch.device("cpu")


def _from_script(payload: dict) -> bool:
    """A checkpoint the train-script flow wrote for a script's declared model: its class
    reference and arguments (`model_spec`), no training config."""
    return "model_spec" in payload and "config" not in payload


def _config(payload: dict, checkpoint: str, **overrides) -> TrainConfig:
    if _from_script(payload):
        raise CheckpointError(f"checkpoint {checkpoint!r} comes from your own script (the train-script flow), "
                              "which names no dataset to evaluate on; use `gpuflow infer` on it")
    if "config" not in payload or "model" not in payload:
        raise CheckpointError(f"checkpoint {checkpoint!r} lacks its config; it was not written by gpuflow")
    return TrainConfig(**{**payload["config"], **{k: v for k, v in overrides.items() if v is not None},
                          "strategy": "single", "device_ids": None, "resume": "never"})


def _model(cfg: TrainConfig, payload: dict, checkpoint: str, num_classes: int, input_shape, dev):
    model = build_model(cfg.model, num_classes, input_shape, cfg.model_args, cfg.code_root)
    load_model_state(model, payload["model"], source=f"checkpoint {checkpoint!r}")
    return model.to(dev).eval()


def _check_shape(shape, expected, what: str, fix: str) -> None:
    """Refuse samples whose shape is not the one the model was trained on (when the checkpoint says it)."""
    if expected is not None and list(shape) != list(expected):
        raise UserError(f"{what} has samples of shape {tuple(shape)}, but the model takes "
                        f"{tuple(expected)} (N x {' x '.join(map(str, expected))}); {fix}")


def load_inputs(path: str) -> torch.Tensor:
    """The `inputs` tensor of a .pt file saved as {'inputs': tensor}, loaded with weights_only=True."""
    save_as = f"save it with torch.save({{'inputs': x}}, {path!r}), x holding N samples of the model's input shape"
    if not path.endswith(".pt"):
        raise UserError(f"inputs file {path!r} is not a .pt file; {save_as}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"inputs file {path!r} cannot be read as tensors ({first[:200]}); {save_as}") from None
    if isinstance(obj, torch.Tensor):
        raise UserError(f"inputs file {path!r} holds a bare tensor of shape {tuple(obj.shape)}, not "
                        f"{{'inputs': tensor}}; {save_as}")
    x = obj.get("inputs") if isinstance(obj, dict) else None
    if not isinstance(x, torch.Tensor):
        got = f"a dict with keys {sorted(map(str, obj))[:8]}" if isinstance(obj, dict) else f"a {type(obj).__name__}"
        raise UserError(f"inputs file {path!r} holds {got}, not {{'inputs': tensor}}; {save_as}")
    return x


def _where(dev: torch.device) -> dict:
    return {"device": str(dev), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "device_name": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"}


def evaluate(checkpoint: str, split: str = "val", device: str = "auto", batch_size: int = 512,
             **overrides) -> dict:
    payload = load_file(checkpoint)
    cfg = _config(payload, checkpoint, **overrides)
    bundle = load_data(cfg, fingerprint=False)
    if bundle.input_shape is not None:
        _check_shape(bundle.input_shape, payload.get("input_shape"), f"dataset {cfg.dataset!r}",
                     "evaluate on a dataset like the one the model was trained on")
    dev = _device(device)
    use_cuda = dev.type == "cuda"
    model = _model(cfg, payload, checkpoint, bundle.num_classes or payload.get("num_classes"),
                   bundle.input_shape, dev)
    objective = load_objective(cfg.objective, cfg.code_root)
    data = bundle.val if split == "val" else _concat(bundle.train, bundle.val)
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, pin_memory=use_cuda)
    totals = Totals(objective)
    with torch.no_grad():
        for batch in loader:
            inputs, target = split_batch(apply(batch, lambda t: t.to(dev)))
            totals.add(objective.forward(model, inputs, target), target,
                       batch_len(target if target is not None else inputs))
    metrics = totals.means()
    if objective.epoch_metrics:
        found = objective.epoch_metrics(concat(totals.outputs), concat(totals.targets))
        metrics.update({k: float(v) for k, v in found.items()})
    return {**metrics, "samples": totals.counts["loss"], "split": split, "model": cfg.model, "dataset": cfg.dataset,
            "objective": cfg.objective, "monitor": objective.monitor, "mode": objective.mode, **_where(dev)}


@torch.no_grad()
def predict(checkpoint: str, inputs: str, device: str = "auto", batch_size: int = 512) -> dict:
    """Class and probabilities for each sample of a tensor file (N x input shape)."""
    payload = load_file(checkpoint)
    x = load_inputs(inputs)
    _check_shape(x.shape[1:], payload.get("input_shape"), f"inputs file {inputs!r}", "reshape the inputs to match")
    dev = _device(device)
    if _from_script(payload):  # the declared model's raw outputs
        spec = payload["model_spec"]
        model = build_model(spec["reference"], None, None, spec["kwargs"], payload.get("code_root"))
        load_model_state(model, payload["model"], source=f"checkpoint {checkpoint!r}")
        out = _outputs(model.to(dev).eval(), x, dev, batch_size, inputs)
        return {"outputs": out.tolist(), "samples": len(x), "model": spec["reference"], **_where(dev)}
    cfg = _config(payload, checkpoint)
    if "num_classes" not in payload:
        raise CheckpointError(f"checkpoint {checkpoint!r} does not record its class count (written by "
                              "an older gpuflow); evaluate it on a dataset instead, or retrain")
    num_classes = payload["num_classes"]
    model = _model(cfg, payload, checkpoint, num_classes, payload.get("input_shape") or list(x.shape[1:]), dev)
    out = _outputs(model, x, dev, batch_size, inputs)
    where = {"samples": len(x), "model": cfg.model, **_where(dev)}
    if cfg.objective != "classification":  # the model's outputs as they are
        return {"outputs": out.tolist(), **where}
    probs = out.softmax(1)
    return {"predictions": probs.argmax(1).tolist(), "probabilities": probs.tolist(), **where}


def _outputs(model, x: torch.Tensor, dev: torch.device, batch_size: int, path: str) -> torch.Tensor:
    try:
        return torch.cat([model(b.to(dev).float()).float().cpu() for b in x.split(batch_size)])
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as e:  # shapes the checkpoint could not name: the model's own words
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"the model cannot take the samples of inputs file {path!r} (shape {tuple(x.shape[1:])} "
                        f"each): {first[:300]}; reshape the inputs to the model's input shape") from None


def _concat(a, b):
    if isinstance(a, TensorData) and isinstance(b, TensorData):
        return torch.utils.data.TensorDataset(torch.cat([a.x, b.x]), torch.cat([a.y, b.y]))
    return torch.utils.data.ConcatDataset([a, b])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a gpuflow checkpoint file")
    p.add_argument("--result", required=True, help="where to write the JSON report")
    p.add_argument("--inputs", help="predict for the tensors in this file instead of evaluating")
    p.add_argument("--split", choices=["val", "all"], default="val")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dataset", help="evaluate on another dataset than the one trained on")
    p.add_argument("--data-root")
    a = p.parse_args(argv)
    try:
        hold_card_locks()  # before the card is touched: no new run gets it until this process is gone
        res = (predict(a.checkpoint, a.inputs, a.device) if a.inputs else
               evaluate(a.checkpoint, a.split, a.device, dataset=a.dataset, data_root=a.data_root))
    except UserError as e:  # the result file carries it to the parent, which prints it once
        write_json_atomic(a.result, {"error": str(e)})
        if sys.stderr.isatty():
            print(f"error: {e}", file=sys.stderr)
        return 2
    write_json_atomic(a.result, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
