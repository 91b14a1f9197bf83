"""MLflow steps of the flow: the run is the flow's, its MLflow work is done by its tracker.

The operations themselves are in tasks/mlrun.py (Prefect-free); the flow's process hands them
to its tracker process (tasks/tracker.py) and only waits for the answers. Only named values
are logged: never the environment wholesale.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from .tracker import Tracker


@task(name="log-results", cache_policy=NO_CACHE)
def log_results(tracker: Tracker, run_id: str, result: dict, workdir: Path, model_name: str,
                registered_name: str, num_classes: int, input_shape: list[int]) -> str:
    """Log checkpoint, curves, worker logs and the registered model; returns the version."""
    return tracker.call("log_results", run_id=run_id, result=result, workdir=str(workdir),
                        model_name=model_name, registered_name=registered_name,
                        num_classes=num_classes, input_shape=list(input_shape))
