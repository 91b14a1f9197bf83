"""The preflight step: what would fail the launch, checked before any MLflow run starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefect import task
from prefect.cache_policies import NO_CACHE

from .launch import check_rendezvous

if TYPE_CHECKING:  # the request: the flows' parameters
    from gpuflow.flows.params import Nodes


def check_resume(cfg, num_classes: int | None, input_shape: list[int] | None) -> None:
    """An explicit resume file must exist, hold only tensors, and fit the model."""
    if cfg.resume in ("auto", "never"):
        return
    from gpuflow.training.builder import make_model
    from gpuflow.training.checkpoint import CheckpointError, load_file, load_model_state

    payload = load_file(cfg.resume)
    if "model" not in payload:
        raise CheckpointError(f"checkpoint {cfg.resume!r} has no 'model' entry; it was not written "
                              "by gpuflow (keys: " + ", ".join(map(str, list(payload)[:8])) + ")")
    model = make_model(cfg.model, num_classes, input_shape, cfg.model_args, cfg.code_root)[0]
    load_model_state(model, payload["model"], source=f"checkpoint {cfg.resume!r}")


@task(name="preflight", cache_policy=NO_CACHE)
def preflight(cfg, opts: Nodes, data, world_size: int = 1) -> int | None:
    """Fail before any MLflow run starts: bad resume file, rendezvous port already taken, a
    training split smaller than the world size, and for the user's own model, data or
    objective, one small batch through them on the CPU (training/preflight.py).
    Returns the class count the worker trains with."""
    from .data import check_split

    check_rendezvous(opts)
    num_classes = data.num_classes
    if cfg.user_code:
        from gpuflow.training.preflight import check_user_code

        num_classes = check_user_code(cfg, world_size)["num_classes"]
    else:
        check_split(cfg, data.num_samples, world_size)
    check_resume(cfg, num_classes, data.input_shape)
    return num_classes
