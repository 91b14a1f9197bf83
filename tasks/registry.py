"""Model Registry steps: find versions, fetch their checkpoints, evaluate on a device, promote."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from .assign import DevicePlan
from .launch import child_environment, run_child

CHAMPION = "champion"


def champion_version(name: str) -> str | None:
    """The version holding the `champion` alias, or None (no model / no alias yet)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        return str(mlflow.MlflowClient().get_model_version_by_alias(name, CHAMPION).version)
    except MlflowException:
        return None


def checkpoint_of(name: str, version: str, dest: Path) -> Path:
    """Download the de-prefixed checkpoint logged by the run that produced a version."""
    import mlflow

    client = mlflow.MlflowClient()
    run_id = client.get_model_version(name, version).run_id
    files = [f.path for f in client.list_artifacts(run_id, "checkpoints") if f.path.endswith(".pt")]
    if not files:
        raise FileNotFoundError(f"model {name} v{version} (run {run_id}) has no logged checkpoint")
    return Path(client.download_artifacts(run_id, sorted(files)[-1], str(dest)))


@task(name="evaluate-checkpoint", cache_policy=NO_CACHE)
def evaluate_checkpoint(checkpoint: Path, plan: DevicePlan, split: str = "val",
                        dataset: str | None = None, data_root: str | None = None) -> dict:
    """Evaluate a checkpoint in a child that sees only the plan's device."""
    cmd = [sys.executable, "-m", "training.evaluate", "--checkpoint", str(checkpoint), "--split", split,
           "--device", plan.device]
    if dataset:
        cmd += ["--dataset", dataset]
    if data_root:
        cmd += ["--data-root", data_root]
    code, tail = run_child(cmd, child_environment(plan, None, None), Path.cwd(), get_run_logger())
    if code != 0:
        raise RuntimeError(f"evaluation of {checkpoint} failed (exit {code}):\n" + "\n".join(tail[-10:]))
    for line in reversed(tail):  # the result is the last JSON line; warnings may follow it
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"evaluation of {checkpoint} printed no result:\n" + "\n".join(tail[-10:]))


@task(name="evaluate-version", cache_policy=NO_CACHE)
def evaluate_version(name: str, version: str, plan: DevicePlan, dataset: str | None = None,
                     data_root: str | None = None) -> dict:
    """Fetch a registered version's checkpoint and evaluate it on the plan's device."""
    with tempfile.TemporaryDirectory() as d:
        ck = checkpoint_of(name, version, Path(d))
        return evaluate_checkpoint.fn(ck, plan, dataset=dataset, data_root=data_root) | {"version": version}


@task(name="promote", cache_policy=NO_CACHE)
def promote(name: str, version: str) -> None:
    """Point the `champion` alias at `version`."""
    import mlflow

    mlflow.MlflowClient().set_registered_model_alias(name, CHAMPION, version)
