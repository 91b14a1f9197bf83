"""The registered model, as MLflow loads it in any process: a pyfunc "model from code" that imports only torch,
numpy and mlflow, rebuilds the model's class from its config and loads the weights with weights_only=True, so
nothing is unpickled.

    model = mlflow.pyfunc.load_model("models:/<name>@champion")
    model.predict(x)                        # x: array (N, *input shape), or {name: array} for forward(**inputs)
    model.unwrap_python_model().model       # the plain nn.Module

What predict returns is what forward returns, as arrays: a tensor's array; a dict's (or ModelOutput's) tensors by
name; a tuple's or list's first tensor, as `(logits, loss)` (nanoGPT) and a Hugging Face model's tuple without labels
put their logits first: return a dict from forward to predict several outputs.
"""

import functools
import importlib
import sys
from collections.abc import Mapping
from pathlib import Path

import mlflow
import numpy as np
from mlflow.pyfunc import PythonModel


def _source(root: Path, module_name: str) -> Path:
    """The file of `module_name` under `root` (the folder holding its top-level package)."""
    path = root.joinpath(*module_name.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _same_code(module_name: str, code: Path, origin: str) -> bool:
    """Whether `module_name`, whose top-level package is already imported from `origin`, has this model's source."""
    top = Path(origin)
    loaded_root = top.parent.parent if top.name == "__init__.py" else top.parent
    mine, theirs = _source(code, module_name), _source(loaded_root, module_name)
    return mine.is_file() and theirs.is_file() and mine.read_bytes() == theirs.read_bytes()


def _shipped(code: Path) -> list[str]:
    """The top-level packages and modules of the model's own code (its `code/` folder)."""
    entries = sorted(code.iterdir()) if code.is_dir() else []
    return [p.stem if p.suffix == ".py" else p.name for p in entries
            if p.suffix == ".py" or (p.is_dir() and p.name != "__pycache__")]


def _import(reference: str, code: Path):
    module_name, _, attr = reference.rpartition(":")
    for top in _shipped(code):  # only code the model ships can differ: an installed package is the environment's
        loaded = sys.modules.get(top)
        origin = getattr(loaded, "__file__", None) or next(iter(getattr(loaded, "__path__", [])), None)
        mine = module_name if module_name.split(".")[0] == top else top
        if origin and code not in Path(origin).resolve().parents and not _same_code(mine, code, origin):
            raise ImportError(f"this model's code holds the package {top!r} (in {code}), but this process has "
                              f"already imported another {top!r} from {origin}; load the model in a fresh "
                              "process, or one that has not imported that module")
    return functools.reduce(getattr, attr.split("."), importlib.import_module(module_name))


class CheckpointModel(PythonModel):
    def load_context(self, context):
        import torch

        spec = context.model_config
        weights = Path(context.artifacts["weights"])
        code = (weights.parent.parent / "code").resolve()
        self.model = _import(spec["reference"], code)(**spec["kwargs"])
        state = torch.load(weights, map_location="cpu", weights_only=True)
        own = set(self.model.state_dict())
        for prefix in ("module.", "_orig_mod."):  # the model's own child named so, which its saved keys lost
            if set(state) != own and {prefix + k for k in state} == own:
                state = {prefix + k: v for k, v in state.items()}
        self.model.load_state_dict(state, strict=True)
        self.model.eval()

    # np.ndarray: the hint MLflow reads as "validate by the signature, not the hint"; dicts pass too
    def predict(self, context, model_input: np.ndarray, params=None):
        """An array (N, *input shape), or {name: array} for forward(**inputs), dtypes kept but floats as float32;
        returns an array, or {name: array} of a dict output's tensors, floats as float32 (see the module's doc)."""
        import torch

        with torch.no_grad():
            if isinstance(model_input, Mapping):
                out = self.model(**{k: _tensor(v) for k, v in model_input.items()})
            else:
                out = self.model(_tensor(model_input))
        if isinstance(out, Mapping):
            return {k: _array(v) for k, v in out.items() if isinstance(v, torch.Tensor)}
        if isinstance(out, (tuple, list)):
            out = _first_tensor(out)
        return _array(out)


def _tensor(value):
    import torch

    a = np.asarray(value)
    return torch.as_tensor(a.astype(np.float32, copy=False) if a.dtype.kind == "f" else a)


def _first_tensor(out):
    """A tuple's or list's first tensor (a None loss before it is skipped); TypeError without one."""
    import torch

    found = next((v for v in out if isinstance(v, torch.Tensor)), None)
    if found is None:
        raise TypeError(f"the model returned a {type(out).__name__} of {', '.join(type(v).__name__ for v in out)}"
                        ", holding no tensor; return a tensor, a dict of tensors, or a tuple whose first is one")
    return found


def _array(t) -> np.ndarray:
    return (t.float() if t.is_floating_point() else t).cpu().numpy()


mlflow.models.set_model(CheckpointModel())
