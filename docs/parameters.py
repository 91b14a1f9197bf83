"""Writes docs/parameters.md from the parameter models (flows/params.py and the services'
settings): every option of every `gpuflow` command, with its default, bounds and help.

    .venv/bin/python docs/parameters.py        # after changing a parameter; tests/test_docs.py fails while stale
"""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path

import annotated_types
from pydantic import BaseModel

from gpuflow.flows.cli import SERVICES, USES
from gpuflow.flows.options import REST
from gpuflow.flows.params import EvaluateParams, InferParams, PipelineParams, RetrainParams, ScriptParams, SweepParams
from gpuflow.flows.settings import NodeService, Settings
from gpuflow.flows.stack import StackService

HERE = Path(__file__).resolve().parent
BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}

# (heading, what it is, the model, the model whose fields it only adds to)
SECTIONS = [
    ("gpuflow run", "the train-pipeline flow (deployments: train-pipeline/*)", PipelineParams, None),
    ("gpuflow run --script", "the train-script flow (train-script/default)", ScriptParams, None),
    ("retrain", "the retrain deployment (retrain/nightly): `gpuflow run`'s parameters, and", RetrainParams,
     PipelineParams),
    ("gpuflow sweep", "the sweep flow: the retrain deployment's parameters, and", SweepParams, RetrainParams),
    ("gpuflow evaluate", "the evaluate-model flow", EvaluateParams, None),
    ("gpuflow infer", "predictions, no flow", InferParams, None),
    *((f"gpuflow {name}", what, {"node": NodeService, "stack": StackService}.get(name, Settings), None)
      for name, what in SERVICES.items()),
]


def kind(field) -> str:
    return _kind(field.annotation)


def _kind(annotation) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:  # a field type with its checks: the type it checks
        return _kind(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(map(_kind, typing.get_args(annotation)))
    if origin is typing.Literal:
        return " \\| ".join(map(str, typing.get_args(annotation)))
    text = getattr(annotation, "__name__", None) or str(annotation)
    return text.replace("typing.", "").replace("NoneType", "None").replace("|", "\\|")


def limits(field) -> str:
    found = [f"{BOUNDS[k]} {getattr(m, k)}" for m in field.metadata if isinstance(m, annotated_types.BaseMetadata)
             for k in BOUNDS if getattr(m, k, None) is not None]
    return ", ".join(found)


def row(name: str, field) -> str:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    option = f"after `--` (`{name}`)" if extra.get("cli") == REST else f"`--{name.replace('_', '-')}`"
    default = "required" if field.is_required() else f"`{json.dumps(field.default)}`"
    help_ = " ".join((field.description or "").split()).replace("|", "\\|")
    return f"| {option} | {kind(field)} | {default} | {limits(field)} | {help_} |"


def render() -> str:
    out = ["# Parameters", "",
           "Generated from the parameter models by `docs/parameters.py`; do not edit by hand. A flow's",
           "parameter is its option's name with `_` for `-` (`--num-workers` is `-p num_workers=...`).",
           "The settings of `gpuflow server`, `serve` and `ui` are also read from `GPUFLOW_<NAME>` variables.", ""]
    for heading, what, model, base in SECTIONS:
        only = USES.get(heading.removeprefix("gpuflow "))  # a service's settings: those it uses
        fields = {n: f for n, f in model.model_fields.items()
                  if (base is None or n not in base.model_fields) and (only is None or n in only)}
        out += [f"## {heading}", "", f"{what[0].upper()}{what[1:]}.", "",
                "| option | type | default | bounds | what it does |", "|---|---|---|---|---|",
                *(row(n, f) for n, f in fields.items()), ""]
    return "\n".join(out)


def write() -> Path:
    path = HERE / "parameters.md"
    path.write_text(render())
    return path


if __name__ == "__main__":
    print(write())
