"""A few lines for your own torchrun script under `gpuflow run --script` (torch only, no Prefect).

    from gpuflow.training import helper

    helper.declare_model("mynet:Net", width=64)      # what the registry rebuilds, once
    start = helper.resume(model, optimizer, scheduler=scheduler)  # epochs already done (0 on a fresh start)
    for epoch in range(start, epochs):
        ...
        helper.report({"loss": loss}, step=epoch + 1)   # live in the flow's MLflow run
        helper.save_checkpoint(model, optimizer, epoch=epoch + 1, scheduler=scheduler)

Every call may be made on every rank: reports and checkpoints are global rank 0's only. Under the flow, files
go to the run's output folder and metrics live to MLflow; under plain torchrun, files go to ./gpuflow-output.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from .checkpoint import (CheckpointError, CheckpointStore, clean_state_dict, load_model_state, model_state, rng_state,
                         set_rng_state, to_cpu)
from .files import write_json_atomic
from .contract import METRICS_FILE_ENV, OUTPUT_DIR_ENV, RunFolder, ranks
from .metrics import EXAMPLE_STEM, MODEL_FILE, format_line


def output_dir() -> Path:
    """Where the script's files go: the run's output folder under the flow, else ./gpuflow-output."""
    return Path(os.environ.get(OUTPUT_DIR_ENV) or "gpuflow-output").resolve()


def is_main() -> bool:
    """Global rank 0 (torchrun's RANK), or a script run without torchrun."""
    return ranks().is_main


def report(metrics: dict[str, float], step: int) -> None:
    """Log `metrics` (floats or 0-d tensors) at `step` to the flow's run, live; rank 0 only."""
    if not is_main():
        return
    line = format_line(step, metrics) + "\n"
    path = os.environ.get(METRICS_FILE_ENV) or str(RunFolder(output_dir()).metrics)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:  # one whole line per write: the relay reads complete lines
        f.write(line)


def declare_model(reference: str, *, input_example=None, **kwargs) -> None:
    """Name the model class (`package.module:Class` or `file.py:Class`) and the keyword arguments that rebuild
    it, so the flow registers the trained weights as a model. `input_example`, a small batch (a tensor, or a dict
    of tensors), becomes the registered model's input example and signature."""
    if not is_main():
        return
    if ":" not in reference:
        raise ValueError(f"declare_model({reference!r}): use package.module:Class or file.py:Class")
    if input_example is not None:
        from .example import save_example

        example = (to_cpu(input_example).numpy() if isinstance(input_example, torch.Tensor)
                   else {k: to_cpu(v).numpy() for k, v in input_example.items()})
        save_example(output_dir() / EXAMPLE_STEM, example)
    write_json_atomic(output_dir() / MODEL_FILE, {"reference": reference, "kwargs": kwargs})


def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, epoch: int,
                    **extra) -> Path | None:
    """Write checkpoints/epoch-<epoch>.pt atomically on rank 0: the unwrapped model's state dict, the optimizer's,
    `epoch` (epochs done), the random generators' states and `extra`: tensors, plain values, or objects with a
    state_dict() (a scheduler, a GradScaler), whose state dict is saved and which resume() restores by the same
    name. The path on rank 0, else None."""
    if not is_main():
        return None
    extra = {k: to_cpu(v.state_dict()) if callable(getattr(v, "state_dict", None)) else v for k, v in extra.items()}
    payload = {"model": clean_state_dict(model_state(model)), "epoch": int(epoch), "rng": rng_state(), **extra}
    if optimizer is not None:
        payload["optimizer"] = to_cpu(optimizer.state_dict())
    return checkpoints().save(payload, int(epoch))


def checkpoints() -> CheckpointStore:
    """The script's checkpoints, as gpuflow's worker keeps its own: epoch-0001.pt, ..."""
    return CheckpointStore(output_dir() / "checkpoints")


def resume(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, **objects) -> int:
    """Load rank 0's newest checkpoint into `model` (and `optimizer`, and each of `objects`, a scheduler or a
    GradScaler saved by save_checkpoint under the same name) on every rank and restore the random generators; the
    epochs it had done (0 when there is none), so `range(resume(...), epochs)` continues with the next one. Called
    after the process group is initialized, every rank takes rank 0's file (only rank 0 saves: another machine's
    ranks have none of their own); before, each takes its own folder's."""
    from .distributed import broadcast_from_main, load_on_every_rank

    group = _group()
    latest = checkpoints().latest() if group.is_main else None
    path = broadcast_from_main(latest and str(latest), group)
    if path is None:
        return 0
    payload = load_on_every_rank(path, group)
    if missing := [k for k in objects if k not in payload]:  # before anything is loaded: all or nothing
        raise CheckpointError(f"checkpoint {path!r} holds no {', '.join(missing)} (it holds "
                              f"{', '.join(sorted(payload))}); save_checkpoint(..., {missing[0]}=...) saves one")
    load_model_state(model, payload["model"], source=f"checkpoint {path!r}")
    if optimizer is not None and "optimizer" in payload:
        optimizer.load_state_dict(payload["optimizer"])
    for name, obj in objects.items():
        obj.load_state_dict(payload[name])
    if "rng" in payload:
        set_rng_state(payload["rng"])
    print(f"[rank {ranks().rank}] resumed from {path} (epoch {payload['epoch']})", flush=True)
    return int(payload["epoch"])


def _group():
    """The script's process group, as gpuflow's collectives take it (one process without one)."""
    import torch.distributed as dist

    from .distributed import DistContext

    if not (dist.is_available() and dist.is_initialized()):
        return DistContext(0, 1, torch.device("cpu"), "single")  # its own folder's
    on_cards = dist.get_backend() == "nccl"  # NCCL's collectives take the rank's card's tensors
    return DistContext(dist.get_rank(), dist.get_world_size(),
                       torch.device("cuda", torch.cuda.current_device()) if on_cards else torch.device("cpu"), "ddp")
