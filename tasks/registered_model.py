"""The registered model, as MLflow loads it: a pyfunc "model from code".

MLflow copies this file into the model and runs it on load, in any process: it imports only
torch, numpy and mlflow, never gpuflow. It rebuilds the model's own class from the reference
and keyword arguments recorded in the model's config (the class's code ships in the model's
`code/` folder: the user's package, or gpuflow's built-in models file) and loads the weights
with `weights_only=True` and `strict=True`, so nothing is unpickled.

    model = mlflow.pyfunc.load_model("models:/<name>@champion")
    model.predict(x)                        # x: float32 array (N, *input shape) -> outputs,
                                            # or {name: array} for a model taking named inputs
    model.unwrap_python_model().model       # the plain nn.Module
"""

import importlib
import sys
from pathlib import Path

import mlflow
import numpy as np
from mlflow.pyfunc import PythonModel


def _import(reference: str, code: Path):
    module_name, _, attr = reference.rpartition(":")
    top = module_name.split(".")[0]
    loaded = sys.modules.get(top)
    origin = getattr(loaded, "__file__", None) or next(iter(getattr(loaded, "__path__", [])), None)
    if loaded is not None and origin and code not in Path(origin).resolve().parents:
        raise ImportError(f"this model's code is the package {top!r} (in {code}), but this process has "
                          f"already imported another {top!r} from {origin}; load the model in a fresh "
                          "process, or one that has not imported that module")
    target = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    return target


class CheckpointModel(PythonModel):
    def load_context(self, context):
        import torch

        spec = context.model_config
        weights = Path(context.artifacts["weights"])
        code = (weights.parent.parent / "code").resolve()
        self.model = _import(spec["reference"], code)(**spec["kwargs"])
        self.model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True), strict=True)
        self.model.eval()

    def predict(self, context, model_input: np.ndarray, params=None) -> np.ndarray:
        import torch

        with torch.no_grad():
            if isinstance(model_input, dict):  # named inputs: forward(**inputs)
                out = self.model(**{k: torch.as_tensor(np.asarray(v)) for k, v in model_input.items()})
            else:
                out = self.model(torch.as_tensor(np.asarray(model_input, dtype=np.float32)))
        if isinstance(out, dict):
            return {k: v.float().numpy() for k, v in out.items()}
        return out.float().numpy()


mlflow.models.set_model(CheckpointModel())
