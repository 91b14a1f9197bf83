"""A registered model on one device: its loss and metrics on a split (`gpuflow evaluate`, the evaluate-model
flow) or its predictions for a file of inputs (`gpuflow infer`), in a child process that sees only that device.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact

from gpuflow.tasks.tracking import store
from gpuflow.tasks.devices.probe import read_environment
from gpuflow.tasks.tracking.registry import checkpoint_of, evaluate_checkpoint, resolve_version, run_on_device

from .checked import checked_flow
from .params import EvaluateParams, InferParams
from .session import on_one_device


@checked_flow(EvaluateParams, name="evaluate-model", flow_run_name="evaluate-{registered_model}-{version}-gpus={gpus}")
def evaluate_model(params: EvaluateParams) -> dict:
    """Load a model version (or a checkpoint) onto one assigned device and report its loss and metrics."""
    with on_one_device(params.gpus) as (plan, fds), tempfile.TemporaryDirectory() as d:  # as training's
        ck, version = model_checkpoint(params, Path(d))
        result = evaluate_checkpoint(ck, plan, params.split, params.dataset, params.data_root, fds)
    result |= {"registered_model": params.registered_model, "version": version, "physical_gpu": plan.primary}
    what = f"`{params.checkpoint}`" if params.checkpoint else f"{params.registered_model} v{version}"
    said = (f"{what} on {result['dataset']} ({result['split']}, {result['samples']} samples), "
            f"device {plan.describe()}: {scores(result)}")
    create_markdown_artifact(key="evaluation", markdown=f"# Evaluation\n\n{said}\n")
    get_run_logger().info(said.replace("**", "").replace("`", ""))  # in the serve terminal and under --watch
    return result


def scores(result: dict) -> str:
    """The monitored metric in bold (accuracy for classification, the objective's own otherwise), then the rest."""
    monitor = result.get("monitor", "accuracy")
    rest = [k for k in ("loss", *sorted(result)) if k != monitor and isinstance(result.get(k), float)]
    shown = [f"**{monitor} {result[monitor]:.4f}**"] if monitor in result else []
    return ", ".join(shown + [f"{k} {result[k]:.4f}" for k in dict.fromkeys(rest)])


def model_checkpoint(params: EvaluateParams | InferParams, folder: Path) -> tuple[Path, str | None]:
    """The checkpoint file to use, and the registered version it came from (None for a file)."""
    if params.checkpoint:
        return Path(params.checkpoint), None
    uri = params.tracking_uri
    store.require_store(uri)  # reading only: never leave an empty mlflow.db behind
    client = store.prepare_store(uri)
    version = resolve_version(client, params.registered_model, params.version)
    return checkpoint_of(client, params.registered_model, version, folder), version


def predict(params: InferParams) -> dict | None:
    """Predictions for `params.inputs` on one device; written to `params.output`, else returned."""
    import logging

    with on_one_device(params.gpus, read_environment, slot=False) as (plan, fds), tempfile.TemporaryDirectory() as d:
        ck, version = model_checkpoint(params, Path(d))
        (out,) = run_on_device([ck], plan, logging.getLogger("gpuflow.infer"), "--inputs",
                               str(Path(params.inputs).resolve()), hold_fds=fds)
    out |= {"registered_model": params.registered_model, "version": version, "physical_gpu": plan.primary}
    if params.output:
        Path(params.output).write_text(json.dumps(out, indent=2))
        return None
    return out
