"""What a finished run logs: checkpoint, worker logs and the registered model."""

from __future__ import annotations

import importlib
import tempfile
import threading
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path

import mlflow
from prefect import task
from prefect.cache_policies import NO_CACHE

from gpuflow.training.contract import RunFolder

from .modelcode import model_code
from .tracked import TrackedRun


OUTCOME_TAG = "gpuflow.outcome"  # on every registered version: promoted, rejected (scores), or not compared
NOT_COMPARED = "registered, not compared: the retrain flow compares a version with the champion"
_warming: threading.Thread | None = None


def warm_model_logging() -> None:
    """Pay MLflow's one-time costs of logging a model in the background, once per process (call it as training
    starts): its model modules' import and the map of installed packages that `save_model`'s requirement check
    builds (it reads every installed distribution's metadata; MLflow keeps the map for the process)."""
    global _warming
    if _warming is None:
        _warming = threading.Thread(target=_warm, name="gpuflow-warm-model-logging", daemon=True)
        _warming.start()


def _warm() -> None:
    with suppress(Exception):  # only a head start: register_model does whatever this did not
        for module in ("mlflow.pyfunc", "mlflow.models.signature"):
            importlib.import_module(module)
        # the check itself, of a requirement the installed mlflow meets: it builds the map and warns of nothing
        # (mlflow.utils is not MLflow's documented API: no public call builds the map; the test says when to drop it)
        from mlflow.utils.requirements_utils import warn_dependency_requirement_mismatches

        warn_dependency_requirement_mismatches(["mlflow"])


def model_signature(example_file: str | None, outputs: list[dict] | None) -> tuple:
    """(the input example: an array, or named arrays from a .npz; its signature, None without one).

    `outputs` is the worker's [{"name", "dtype", "shape"}], one unnamed entry for a tensor output."""
    import numpy as np
    from mlflow.models.signature import ModelSignature
    from mlflow.types.schema import Schema, TensorSpec

    if not example_file:
        return None, None
    example = np.load(example_file)
    if isinstance(example, np.lib.npyio.NpzFile):  # named inputs
        example = dict(example)
    named = example.items() if isinstance(example, dict) else [(None, example)]
    # integer inputs (token ids, attention masks) take any length: only the batch is free otherwise
    free = (lambda a: (-1,) * a.ndim if np.issubdtype(a.dtype, np.integer) else (-1, *a.shape[1:]))
    return example, ModelSignature(
        inputs=Schema([TensorSpec(a.dtype, free(a), name) for name, a in named]),
        outputs=Schema([TensorSpec(np.dtype(o["dtype"]), (-1, *o["shape"]), o["name"]) for o in outputs])
        if outputs else None)


@contextmanager
def quiet_logger(name: str):
    """`name`'s warnings off for the block."""
    import logging

    logger = logging.getLogger(name)
    level, logger.level = logger.level, logging.ERROR
    try:
        yield
    finally:
        logger.level = level


@contextmanager
def failed_unless_ready(client, model_id: str):
    """Whatever stops the block (an error, SIGTERM, Ctrl-C) before the logged model is READY
    ends it FAILED: MLflow would otherwise show it PENDING forever."""
    from mlflow.entities import LoggedModelStatus

    try:
        yield
    except BaseException:
        if client.get_logged_model(model_id).status != LoggedModelStatus.READY:
            client.finalize_logged_model(model_id, LoggedModelStatus.FAILED)
        raise


def register_model(run: TrackedRun, result: dict, registered_name: str, code_root: str | None, description: str) -> str:
    """Log the trained weights as a pyfunc model with the model's own code and register it; the version.
    Idempotent per run."""
    if _warming is not None:  # its work is this function's first steps: not done twice (unless it takes a minute)
        _warming.join(60)
    from mlflow.entities import LoggedModelOutput
    from mlflow.exceptions import MlflowException

    existing = run.client.search_model_versions(f"name='{registered_name}' and run_id='{run.run_id}'")
    if existing:  # a retried task must not create a second version
        return existing[0].version
    example, signature = model_signature(result.get("input_example"), result.get("output_spec"))
    say_what_predict_returns(result.get("output_spec"))
    # pyfunc.log_model's steps without its check that predicts the example, which would import torch into the flow
    with tempfile.TemporaryDirectory() as tmp:
        reference, code_paths = model_code(result["model_spec"], code_root, Path(tmp))  # refused before it is logged
        model = run.client.create_logged_model(run.experiment_id, name="model", source_run_id=run.run_id)
        with failed_unless_ready(run.client, model.model_id), \
                (quiet_logger("mlflow.pyfunc") if signature is None else nullcontext()):  # no "Failed to infer" warning
            _save(run, model, result, reference, code_paths, code_root, signature, example, Path(tmp))
    run.client.log_outputs(run.run_id, [LoggedModelOutput(model.model_id, step=0)])
    try:
        run.client.create_registered_model(registered_name)
    except MlflowException as e:  # it exists already (or was just created by a concurrent run)
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    mv = run.client.create_model_version(registered_name, model.model_uri, run.run_id, model_id=model.model_id,
                                         description=description, tags={OUTCOME_TAG: NOT_COMPARED})
    return str(mv.version)


def _save(run: TrackedRun, model, result: dict, reference: str, code_paths: list[str], code_root: str | None,
          signature, example, tmp: Path) -> None:
    """Save the pyfunc model in `tmp`, log it as the logged model `model`'s artifacts and mark it READY."""
    from mlflow.entities import LoggedModelStatus
    from mlflow.models import Model

    from .requirements import model_requirements

    mlflow.pyfunc.save_model(
        tmp / "model", python_model=str(Path(__file__).with_name("registered_model.py")),
        artifacts={"weights": result["weights"]}, code_paths=code_paths or None,
        model_config={"reference": reference, "kwargs": result["model_spec"]["kwargs"]},
        signature=signature, input_example=example, pip_requirements=model_requirements(reference, code_paths,
                                                                                        code_root),
        mlflow_model=Model(artifact_path=model.artifact_location, run_id=run.run_id, model_id=model.model_id,
                           model_uuid=model.model_id))
    run.client.log_model_artifacts(model.model_id, str(tmp / "model"))
    run.client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)


def say_what_predict_returns(outputs: list[dict] | None) -> None:
    """One line in the run's log when the model returns a tuple or list: its registered model's predict returns
    the element the worker described (registered_model.py's rule), not the whole sequence."""
    picked = next((o for o in outputs or [] if "element" in o), None)
    if picked is not None:
        _run_log().info("the model returns a %s: its registered model's predict returns its first tensor alone "
                        "(element %d, shape (N, %s): logits first, as nanoGPT and Hugging Face order them); return "
                        "a dict from forward to predict several named outputs", picked["container"],
                        picked["element"], ", ".join(map(str, picked["shape"])))


def _run_log():
    """The flow or task run's logger, whose lines reach the Prefect UI too; else this module's."""
    import logging

    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


@task(name="log-results", cache_policy=NO_CACHE)
def log_results(run: TrackedRun, result: dict, registered_name: str | None, code_root: str | None,
                description: str) -> str | None:
    """Log checkpoint, result, worker logs and the registered model; returns the version (none
    without a name: a sweep registers its best trial's alone).

    No curves image: the MLflow UI charts the per-epoch metrics the relay logged, live."""
    client, run_id = run.client, run.run_id
    client.set_tag(run_id, "torchrun_restarts", str(result.get("restarts", 0)))
    run.log_json(result, "result.json", "training")
    if result.get("checkpoint"):
        client.log_artifact(run_id, result["checkpoint"], "checkpoints")
    folder = RunFolder(run.workdir)
    if folder.logs.is_dir():
        client.log_artifacts(run_id, str(folder.logs), "worker-logs")
    client.log_artifact(run_id, str(folder.config), "training")
    return register_model(run, result, registered_name, code_root, description) if registered_name else None
