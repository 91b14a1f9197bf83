"""gpuflow's flows, to call from Python (a Prefect user's own flow, a notebook; docs/deployments.md).

Each flow takes its `gpuflow` command's parameters as keywords and returns what the command prints as JSON.
Imported on first use: `import gpuflow.flows` alone imports neither Prefect nor MLflow.
"""

import sys
from importlib import import_module
from types import ModuleType

PUBLIC = {"train_pipeline": ".train", "train_script": ".script", "retrain": ".retrain",
          "evaluate_model": ".infer", "sweep": ".sweep", "prefect_api": ".api", "InvalidParameters": ".calls"}
__all__ = list(PUBLIC)


class _Flows(ModuleType):
    """`gpuflow.flows.sweep` and `.retrain` are the flows, not the submodules of the same name
    (reach those with `importlib.import_module("gpuflow.flows.sweep")`)."""

    def __getattribute__(self, name: str):
        if name in PUBLIC:
            return getattr(import_module(PUBLIC[name], __name__), name)
        return super().__getattribute__(name)


sys.modules[__name__].__class__ = _Flows
