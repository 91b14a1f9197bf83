"""Evaluate or apply a checkpoint on one device, reporting through a JSON file.

    python -m gpuflow.training.evaluate --checkpoint CK [CK ...] --result OUT.json [--dataset D ...]
    python -m gpuflow.training.evaluate --checkpoint CK --result OUT.json --inputs X.pt

Loads only tensors (weights_only=True) and rebuilds the plain model from the config stored
in the checkpoint. Without --inputs: loss and the objective's metrics (accuracy for
classification) on the dataset's validation split (the same deterministic split training
held out) or on all of it. With --inputs (N samples: {'inputs': tensor} or {'inputs':
{name: tensor}} in a .pt file, a .npy array or a .npz of named arrays; dtypes kept, named
inputs passed as forward(**inputs)): the predicted class and class probabilities of each,
or the model's raw outputs ({name: outputs} for a dict output) for an objective of your
own. Run it in a child whose CUDA_VISIBLE_DEVICES holds the card to use: inside, that card
is cuda:0.
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import sys
from collections.abc import Mapping

import torch

from .cardlock import hold_card_locks
from .checkpoint import CheckpointError, load_file, load_model_state
from .config import TrainConfig
from .builder import make_model
from .data import load_data
from .errors import UserError
from .files import write_json_atomic
from .lifetime import leave
from .policy import Policy
from .objective import (Classification, Totals, apply, batch_len, call_model, concat, load_objective, shapes,
                        split_batch)


def _device(device: str) -> torch.device:
    return torch.device("cuda", 0) if device != "cpu" and torch.cuda.is_available() else torch.device("cpu")


def _from_script(payload: dict) -> bool:
    """A checkpoint written for a script's declared model: a `model_spec`, no training config."""
    return "model_spec" in payload and "config" not in payload


def _vetted(payload: dict, checkpoint: str) -> dict:
    """The payload, once what it names passed a served run's policy: a store is as untrusted as a caller."""
    policy = Policy.from_env()
    if policy is not None:
        source = f"checkpoint {os.path.basename(checkpoint)}"
        if _from_script(payload):
            spec = payload["model_spec"] if isinstance(payload["model_spec"], dict) else None
            policy.check_config(spec and {**spec, "code_root": payload.get("code_root")}, source)
        else:
            policy.check_config(payload.get("config"), source)
    return payload


def _config(payload: dict, checkpoint: str, **overrides) -> TrainConfig:
    if _from_script(payload):
        raise CheckpointError(f"checkpoint {checkpoint!r} comes from your own script (the train-script flow), "
                              "which names no dataset to evaluate on; use `gpuflow infer` on it")
    if "config" not in payload or "model" not in payload:
        raise CheckpointError(f"checkpoint {checkpoint!r} lacks its config; it was not written by gpuflow")
    given = {k: v for k, v in overrides.items() if v is not None}
    if given.keys() & {"dataset", "data_root"}:  # other data: never the prepared copy this checkpoint trained on
        given["data_cache"] = overrides.get("data_cache")
    return TrainConfig(**{**payload["config"], **given, "strategy": "single", "device_ids": None, "resume": "never"})


SAME_DATA = ("dataset", "data_root", "data_cache", "val_fraction", "split_seed", "synthetic_size",
             "synthetic_side")  # which samples a split holds


def _model(payload: dict, checkpoint: str, dev: torch.device, *build):
    """The model `make_model(*build)` builds, with the checkpoint's weights, on `dev`, in eval mode."""
    model = make_model(*build)[0]
    load_model_state(model, payload["model"], source=f"checkpoint {checkpoint!r}")
    return model.to(dev).eval()


def _check_shape(shape, expected, what: str, fix: str) -> None:
    """Refuse samples whose shape is not the one the model was trained on (when the checkpoint says it)."""
    if expected is not None and list(shape) != list(expected):
        raise UserError(f"{what} has samples of shape {tuple(shape)}, but the model takes "
                        f"{tuple(expected)} (N x {' x '.join(map(str, expected))}); {fix}")


SAVE_INPUTS = ("save it with torch.save({{'inputs': x}}, {path!r}), x a tensor of N samples of the model's input "
               "shape, or a dict of such tensors by the model's input names (or np.save / np.savez arrays)")


def load_inputs(path: str) -> torch.Tensor | dict[str, torch.Tensor]:
    """A tensor or {name: tensor} (keyword inputs), dtypes kept, from a .pt file saved as {'inputs': ...}, a .npy
    array or a .npz of named arrays; UserError naming how to save it otherwise."""
    save_as = SAVE_INPUTS.format(path=path)
    if path.endswith((".npy", ".npz")):
        return _named_inputs(_load_arrays(path, save_as), path, save_as)
    if not path.endswith(".pt"):
        raise UserError(f"inputs file {path!r} is not a .pt, .npy or .npz file; {save_as}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as e:
        raise UserError(f"inputs file {path!r} cannot be read as tensors ({_first_line(e)}); {save_as}") from None
    if isinstance(obj, torch.Tensor):
        raise UserError(f"inputs file {path!r} holds a bare tensor of shape {tuple(obj.shape)}, not "
                        f"{{'inputs': tensor}}; {save_as}")
    x = obj.get("inputs") if isinstance(obj, dict) else None
    if isinstance(x, (torch.Tensor, dict)):
        return _named_inputs(x, path, save_as)
    got = f"a dict with keys {sorted(map(str, obj))[:8]}" if isinstance(obj, dict) else f"a {type(obj).__name__}"
    raise UserError(f"inputs file {path!r} holds {got}, not {{'inputs': tensor}} or {{'inputs': {{name: tensor}}}}; "
                    f"{save_as}")


def _load_arrays(path: str, save_as: str):
    import zipfile

    import numpy as np

    try:
        loaded = np.load(path, allow_pickle=False)
        arrays = dict(loaded) if isinstance(loaded, np.lib.npyio.NpzFile) else loaded
        return ({k: torch.from_numpy(a) for k, a in arrays.items()} if isinstance(arrays, dict)
                else torch.from_numpy(arrays))
    except (ValueError, OSError, EOFError, TypeError, zipfile.BadZipFile) as e:
        raise UserError(f"inputs file {path!r} cannot be read as numeric arrays ({_first_line(e)}); "
                        f"{save_as}") from None


def _named_inputs(x, path: str, save_as: str):
    """`x` itself when it is a tensor, or named tensors of one sample count."""
    if isinstance(x, torch.Tensor):
        return x
    if not x:
        raise UserError(f"inputs file {path!r} names no inputs (an empty dict); {save_as}")
    bad = [str(k) for k, v in x.items() if not (isinstance(k, str) and isinstance(v, torch.Tensor) and v.dim() > 0)]
    if bad:
        raise UserError(f"inputs file {path!r} names inputs {bad[:8]} that are not tensors of N samples; {save_as}")
    counts = {k: len(v) for k, v in x.items()}
    if len(set(counts.values())) > 1:
        raise UserError(f"inputs file {path!r} holds named inputs of different sample counts {counts}; "
                        "give every input the same N samples")
    return x


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)[:200]


def _where(dev: torch.device) -> dict:
    return {"device": str(dev), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "device_name": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"}


def evaluate(checkpoint: str, split: str = "val", device: str = "auto", batch_size: int = 512,
             **overrides) -> tuple[dict, TrainConfig]:
    """The checkpoint's loss and metrics on a split of its data (or of the data `overrides` name); and the config
    it was evaluated with."""
    payload = _vetted(load_file(checkpoint), checkpoint)
    cfg = _config(payload, checkpoint, **overrides)
    bundle = load_data(cfg, fingerprint=False)
    if bundle.input_shape is not None:
        _check_shape(bundle.input_shape, payload.get("input_shape"), f"dataset {cfg.dataset!r}",
                     "evaluate on a dataset like the one the model was trained on")
    dev = _device(device)
    model = _model(payload, checkpoint, dev, cfg.model, bundle.num_classes or payload.get("num_classes"),
                   bundle.input_shape, cfg.model_args, cfg.code_root)
    objective = load_objective(cfg.objective, cfg.code_root)
    data = bundle.val if split == "val" else torch.utils.data.ConcatDataset([bundle.train, bundle.val])
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, pin_memory=dev.type == "cuda")
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
            "objective": cfg.objective, "monitor": objective.monitor, "mode": objective.mode, **_where(dev)}, cfg


@torch.no_grad()
def predict(checkpoint: str, inputs: str, device: str = "auto", batch_size: int = 512) -> dict:
    """Class and probabilities for each sample of an inputs file, or the model's outputs for an own objective."""
    payload = _vetted(load_file(checkpoint), checkpoint)
    x = load_inputs(inputs)
    if isinstance(x, torch.Tensor):
        _check_shape(x.shape[1:], payload.get("input_shape"), f"inputs file {inputs!r}", "reshape the inputs to match")
    dev = _device(device)
    if _from_script(payload):  # the declared model's raw outputs
        spec = payload["model_spec"]
        model = _model(payload, checkpoint, dev, spec["reference"], None, None, spec["kwargs"],
                       payload.get("code_root"))
        out = _outputs(model, x, dev, batch_size, inputs)
        return {"outputs": _listed(out), "samples": batch_len(x), "model": spec["reference"], **_where(dev)}
    cfg = _config(payload, checkpoint)
    if "num_classes" not in payload:
        raise CheckpointError(f"checkpoint {checkpoint!r} does not record its class count (written by "
                              "an older gpuflow); evaluate it on a dataset instead, or retrain")
    shape = payload.get("input_shape") or (list(x.shape[1:]) if isinstance(x, torch.Tensor) else None)
    model = _model(payload, checkpoint, dev, cfg.model, payload["num_classes"], shape, cfg.model_args, cfg.code_root)
    out = _outputs(model, x, dev, batch_size, inputs)
    where = {"samples": batch_len(x), "model": cfg.model, **_where(dev)}
    if cfg.objective != "classification":  # the model's outputs as they are
        return {"outputs": _listed(out), **where}
    probs = Classification.scores(out).softmax(1)
    return {"predictions": probs.argmax(1).tolist(), "probabilities": probs.tolist(), **where}


def _outputs(model, x, dev: torch.device, batch_size: int, path: str):
    """The model's outputs for every sample of `x`, batch by batch, on the CPU; floats run as float32, as the
    weights are, other dtypes kept."""
    to_model = (lambda t: t.to(dev).float() if t.is_floating_point() else t.to(dev))
    n = batch_len(x)
    try:
        return concat([_on_cpu(call_model(model, apply(x, lambda t: to_model(t[i:i + batch_size]))), path)
                       for i in range(0, n, batch_size)])
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, TypeError, IndexError) as e:  # inputs the checkpoint could not check: the model's words
        each = shapes(apply(x, lambda t: t[0]))
        raise UserError(f"the model cannot take the samples of inputs file {path!r} ({each} each): "
                        f"{_first_line(e)[:300]}; give the inputs the model's input names, shapes and dtypes") from None


def _on_cpu(out, path: str):
    """A batch's outputs as float32 (floating) CPU tensors; a dict's non-tensor entries (a None loss) left out, a
    tuple's or list's first tensor alone, as the registered model's predict returns (logits first, as nanoGPT)."""
    cpu = (lambda t: t.float().cpu() if t.is_floating_point() else t.cpu())
    if isinstance(out, (tuple, list)):
        out = next((v for v in out if isinstance(v, torch.Tensor)), out)
    if isinstance(out, torch.Tensor):
        return cpu(out)
    if isinstance(out, Mapping):
        return {k: cpu(v) for k, v in out.items() if isinstance(v, torch.Tensor)}
    raise UserError(f"the model returned a {type(out).__name__} for the samples of inputs file {path!r}; "
                    "`gpuflow infer` reports a tensor, a dict of tensors or a tuple's first tensor: return one "
                    "from forward")


def _listed(out) -> list | dict:
    return {k: v.tolist() for k, v in out.items()} if isinstance(out, dict) else out.tolist()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpuflow.training.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, nargs="+", help="gpuflow checkpoint files: several are "
                   "evaluated in turn (a list of reports, one each)")
    p.add_argument("--result", required=True, help="where to write the JSON report")
    p.add_argument("--inputs", help="predict for the tensors in this file instead of evaluating")
    p.add_argument("--split", choices=["val", "all"], default="val")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dataset", help="evaluate on another dataset than the one trained on")
    p.add_argument("--data-root")
    a = p.parse_args(argv)
    try:
        hold_card_locks()  # before the card is touched: no new run gets it until this process is gone
        if a.inputs and len(a.checkpoint) > 1:
            raise UserError("--inputs: give one --checkpoint")
        if a.inputs:
            res = [predict(a.checkpoint[0], a.inputs, a.device)]
        else:
            res, same = [], {"dataset": a.dataset, "data_root": a.data_root}
            for ck in a.checkpoint:  # each on the first one's samples: compared on the same data
                report, cfg = evaluate(ck, a.split, a.device, **same)
                res.append(report)
                same = {k: getattr(cfg, k) for k in SAME_DATA}
    except UserError as e:  # the result file carries it to the parent, which prints it once
        write_json_atomic(a.result, {"error": str(e)})
        if sys.stderr.isatty():
            print(f"error: {e}", file=sys.stderr)
        return 2
    write_json_atomic(a.result, res)
    return 0


if __name__ == "__main__":
    gc.freeze()  # torch's and the modules' objects live to the end: no collection scans them
    leave(main())  # the report is written
