"""gpuflow's flows, to call from Python (a Prefect user's own flow, a notebook):

    from prefect import flow
    from gpuflow.flows import prefect_api, train_pipeline

    @flow
    def my_flow():
        out = train_pipeline(model="myproj.nets:Net", dataset="myproj.data:datasets", epochs=3)
        return out["model_version"]

    with prefect_api():  # gpuflow's temporary Prefect API, unless PREFECT_API_URL is set
        my_flow()

Each flow takes the same parameters as its `gpuflow` command and deployments (keyword
arguments; `gpuflow run --help` lists them) and returns what the command prints as JSON.
Imported on first use: `import gpuflow.flows` alone imports neither Prefect nor MLflow.
"""

import sys
from importlib import import_module
from types import ModuleType

PUBLIC = {"train_pipeline": ".train", "train_script": ".script", "retrain": ".retrain",
          "evaluate_model": ".infer", "sweep": ".sweep", "prefect_api": ".api", "InvalidParameters": ".calls"}
__all__ = list(PUBLIC)


class _Flows(ModuleType):
    """`gpuflow.flows.sweep` and `.retrain` are the flows, not the modules of the same name that
    Python's import sets on the package once anything imported them (reach a module with
    `importlib.import_module("gpuflow.flows.sweep")`)."""

    def __getattribute__(self, name: str):
        if name in PUBLIC:
            return getattr(import_module(PUBLIC[name], __name__), name)
        return super().__getattribute__(name)

    def __getattr__(self, name: str):
        raise AttributeError(f"module 'gpuflow.flows' has no attribute {name!r}")


sys.modules[__name__].__class__ = _Flows
