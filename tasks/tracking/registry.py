"""Model Registry steps: find versions, fetch their checkpoints, evaluate on a device, promote."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from gpuflow.training.errors import UserError

from ..devices.assign import DevicePlan
from ..child import run_child
from ..launch import child_environment

CHAMPION = "champion"


class EvaluationFailed(RuntimeError):
    """The evaluation child failed; the message carries its last lines of output."""


class EvaluationRefused(UserError):
    """The evaluation child refused its input (checkpoint, inputs file, dataset); its one-line message."""


class ModelNotFound(UserError):
    """No registered model of that name in the tracking store."""


def check_model_exists(client, name: str) -> None:
    """Refuse a registered-model name the store does not hold, naming those it does."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
        return
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
    names = [m.name for m in client.search_registered_models(max_results=20)]
    there = f"the models there: {', '.join(names)}" if names else "it holds no registered model yet (train one first)"
    raise ModelNotFound(f"registered model {name!r} does not exist in {client.tracking_uri}; {there}; "
                        "pass --registered-model NAME")


def champion_version(client, name: str) -> str | None:
    """The version holding the `champion` alias, or None (no model / no alias yet)."""
    from mlflow.exceptions import MlflowException

    try:
        return str(client.get_model_version_by_alias(name, CHAMPION).version)
    except MlflowException:
        return None


def resolve_version(client, name: str, version: str) -> str:
    """A version number, or the one the `champion` alias points at."""
    check_model_exists(client, name)
    if version != CHAMPION:
        return version
    if (found := champion_version(client, name)) is not None:
        return found
    have = sorted(int(v.version) for v in client.search_model_versions(f"name='{name}'"))
    newest = have[-1] if have else "N"
    raise UserError(f"model {name!r} has no 'champion' yet (the retrain flow sets it); choose one of its versions "
                    f"({', '.join(map(str, have)) or 'none'}): --version {newest} on the command line, "
                    f"-p version={newest} for a deployment")


def checkpoint_of(client, name: str, version: str, dest: Path) -> Path:
    """Download the de-prefixed checkpoint logged by the run that produced a version."""
    from mlflow.exceptions import MlflowException

    try:
        run_id = client.get_model_version(name, version).run_id
    except MlflowException as e:
        raise UserError(f"registered model {name!r} has no version {version!r} in "
                        f"{client.tracking_uri} ({e.error_code}); list them in the MLflow UI") from None
    files = [f.path for f in client.list_artifacts(run_id, "checkpoints") if f.path.endswith(".pt")]
    if not files:
        raise UserError(f"model {name} v{version} (run {run_id}) has no logged checkpoint; "
                        "it was not registered by gpuflow, pick another version")
    return Path(client.download_artifacts(run_id, sorted(files)[-1], str(dest)))


def run_on_device(checkpoints: list[Path], plan: DevicePlan, log, *args: str,
                  hold_fds: tuple[int, ...] = ()) -> list[dict]:
    """Run gpuflow.training.evaluate on `checkpoints`, one after the other, in one child that sees only the plan's
    device; its JSON reports, one per checkpoint. The caller holds card_locks(plan); the child holds `hold_fds`,
    their descriptors, too."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "result.json"
        cmd = [sys.executable, "-m", "gpuflow.training.evaluate", "--checkpoint", *map(str, checkpoints),
               "--device", plan.device, "--result", str(out), *args]
        code, tail = run_child(cmd, child_environment(plan), Path.cwd(), log, hold_fds)
        report = json.loads(out.read_text()) if out.is_file() else None
        if code == 2 and isinstance(report, dict) and "error" in report:
            raise EvaluationRefused(report["error"])
        if code != 0 or report is None:
            raise EvaluationFailed(f"evaluation of {', '.join(map(str, checkpoints))} failed (exit {code}):\n"
                                   + "\n".join(tail[-10:]))
        return report


def _data_args(dataset: str | None, data_root: str | None) -> list[str]:
    return [*(["--dataset", dataset] if dataset else []), *(["--data-root", data_root] if data_root else [])]


@task(name="evaluate-checkpoint", cache_policy=NO_CACHE)
def evaluate_checkpoint(checkpoint: Path, plan: DevicePlan, split: str = "val", dataset: str | None = None,
                        data_root: str | None = None, hold_fds: tuple[int, ...] = ()) -> dict:
    """Loss and accuracy of a checkpoint on a dataset split, on the plan's one device (see run_on_device)."""
    return run_on_device([checkpoint], plan, get_run_logger(), "--split", split, *_data_args(dataset, data_root),
                         hold_fds=hold_fds)[0]


@task(name="evaluate-versions", cache_policy=NO_CACHE)
def evaluate_versions(client, name: str, versions: list[str], plan: DevicePlan, dataset: str | None = None,
                      data_root: str | None = None, hold_fds: tuple[int, ...] = ()) -> list[dict]:
    """Fetch registered versions' checkpoints and evaluate them on the plan's device, in one child (one torch
    import, one dataset load)."""
    with tempfile.TemporaryDirectory() as d:
        cks = [checkpoint_of(client, name, v, Path(d) / f"v{v}") for v in versions]
        reports = run_on_device(cks, plan, get_run_logger(), *_data_args(dataset, data_root), hold_fds=hold_fds)
    return [r | {"version": v} for r, v in zip(reports, versions)]


@task(name="promote", cache_policy=NO_CACHE)
def promote(client, name: str, version: str) -> None:
    """Point the `champion` alias at `version`."""
    client.set_registered_model_alias(name, CHAMPION, version)
