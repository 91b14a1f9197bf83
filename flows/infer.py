"""Inference on a chosen device: evaluate a registered version (or a checkpoint file).

    python -m flows.infer --registered-model gpuflow-model --version champion --gpus 3,
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from tasks.assign import DevicePlan, DeviceRequest, assign_devices
from tasks.probe import probe_environment
from tasks.registry import champion_version, checkpoint_of, evaluate_checkpoint
from tasks.mlrun import default_tracking_uri, prepare_store


def single_device_request(gpus: str) -> DeviceRequest:
    """One device: a named card ('3,' or '3'), the freest card ('auto'), or 'cpu'."""
    if gpus.isdigit():
        gpus += ","  # here a bare number names a card: inference uses exactly one
    return DeviceRequest(gpus="1" if gpus == "auto" else gpus, strategy="single")


def assign_one_device(gpus: str) -> DevicePlan:
    """Probe, then assign the one device `gpus` names; `auto` falls back to the CPU without GPUs."""
    report = probe_environment()
    no_gpu = not report.visible_physical_ids()
    return assign_devices(report, single_device_request("cpu" if no_gpu and gpus == "auto" else gpus),
                          batch_size=1)


@flow(name="evaluate-model", flow_run_name="evaluate-{registered_model}-{version}-gpus={gpus}")
def evaluate_model(registered_model: str = "gpuflow-model", version: str = "champion",
                   checkpoint: str | None = None, gpus: str = "auto", split: str = "val",
                   dataset: str | None = None, data_root: str | None = None,
                   tracking_uri: str | None = None) -> dict:
    """Load a model version (or a checkpoint) onto one assigned device and report accuracy."""
    plan = assign_one_device(gpus)
    with tempfile.TemporaryDirectory() as d:
        if checkpoint is None:
            prepare_store(tracking_uri or default_tracking_uri())
            if version == "champion":
                version = champion_version(registered_model) or _no_champion(registered_model)
            ck = checkpoint_of(registered_model, version, Path(d))
        else:
            ck = Path(checkpoint)
        result = evaluate_checkpoint(ck, plan, split, dataset, data_root)
    result |= {"registered_model": registered_model, "version": version if checkpoint is None else None,
               "physical_gpu": plan.primary}
    create_markdown_artifact(key="evaluation", markdown=(
        f"# Evaluation\n\n{'`' + str(checkpoint) + '`' if checkpoint else f'{registered_model} v{version}'} "
        f"on {result['dataset']} ({result['split']}, {result['samples']} samples), device "
        f"{plan.describe()}: **accuracy {result['accuracy']:.4f}**, loss {result['loss']:.4f}\n"))
    return result


def _no_champion(name: str) -> str:
    raise ValueError(f"model {name!r} has no 'champion' alias yet; run the retrain flow first "
                     "or pass --version N")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flows.infer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--registered-model", default="gpuflow-model")
    p.add_argument("--version", default="champion", help="a version number or 'champion'")
    p.add_argument("--checkpoint", help="evaluate this checkpoint file instead of a registered version")
    p.add_argument("--gpus", default="auto", help="physical GPU id (e.g. 3), auto, or cpu")
    p.add_argument("--split", choices=["val", "all"], default="val")
    p.add_argument("--dataset")
    p.add_argument("--data-root")
    p.add_argument("--tracking-uri")
    a = vars(p.parse_args(argv))
    from .cli import exit_on_sigterm

    exit_on_sigterm()
    print(json.dumps(evaluate_model(**a), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
