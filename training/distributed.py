"""Process-group setup from the environment torchrun sets; never from arguments."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .checkpoint import CheckpointError, load_file
from .config import FP16_NEEDS_CUDA, TrainConfig, batch_split
from .compat import attempt_store
from .contract import ranks
from .errors import UserError


class LaunchError(UserError):
    """The process was started in a way that cannot work; the message says how to start it."""


@dataclass
class DistContext:
    rank: int
    world_size: int
    device: torch.device
    strategy: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.strategy == "ddp"


def _pick_device(cfg: TrainConfig, local_rank: int) -> torch.device:
    cuda = torch.cuda.is_available()
    if cfg.device == "cuda" and not cuda:
        raise LaunchError("device 'cuda' was asked for but this process sees no GPU (CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); use device 'cpu' or 'auto'")
    if not (cuda and cfg.device != "cpu"):
        if cfg.precision == "fp16":
            raise LaunchError(FP16_NEEDS_CUDA)
        return torch.device("cpu")
    if cfg.strategy != "ddp":
        return torch.device("cuda", 0)
    if local_rank >= torch.cuda.device_count():
        raise LaunchError(f"local rank {local_rank} has no GPU: this process sees {torch.cuda.device_count()}; "
                          "start torchrun with --nproc_per_node at most the number of visible GPUs")
    torch.cuda.set_device(local_rank)  # before anything else touches CUDA
    return torch.device("cuda", local_rank)


def setup(cfg: TrainConfig) -> DistContext:
    """Read ranks from the environment, pick the device, init the process group for DDP."""
    here = ranks()
    world = here.world_size
    if cfg.strategy == "ddp" and not here.under_torchrun:
        raise LaunchError("strategy 'ddp' needs torchrun: torchrun --nproc_per_node=N -m gpuflow.training --config CFG")
    if cfg.strategy != "ddp" and world > 1:
        raise LaunchError(f"strategy {cfg.strategy!r} runs as one process but WORLD_SIZE={world}; "
                          "use strategy 'ddp' under torchrun, or run with python -m gpuflow.training")
    if cfg.strategy == "ddp" and (why := batch_split(cfg.batch_size, world, "processes", world)):
        raise LaunchError(why)
    device = _pick_device(cfg, here.local_rank)
    if cfg.strategy == "ddp":
        backend = "nccl" if device.type == "cuda" else "gloo"
        init_group(backend, timedelta(seconds=cfg.dist_timeout_s))
    return DistContext(here.rank, world, device, cfg.strategy)


def init_group(backend: str, timeout: timedelta) -> None:
    """init_process_group on the env:// store, under a key prefix unique to this attempt (pytorch#167288)."""
    from torch.distributed.rendezvous import rendezvous

    store, rank, world = next(rendezvous("env://", timeout=timeout))
    dist.init_process_group(backend, store=attempt_store(store, ranks().restarts), rank=rank, world_size=world,
                            timeout=timeout)


def all_reduce_sum(values: list[float], ctx: DistContext) -> list[float]:
    """Sum values over all ranks (identity for a single process)."""
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    if ctx.distributed:
        dist.all_reduce(t)
    return t.tolist()


def gather_to_main(obj, ctx: DistContext) -> list | None:
    """Every rank's `obj` (CPU tensors, numbers), as a list in rank order on rank 0; None elsewhere."""
    if not ctx.distributed:
        return [obj]
    out = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def broadcast_from_main(obj, ctx: DistContext):
    """Rank 0's `obj` on every rank."""
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def load_on_every_rank(path: str, ctx: DistContext) -> dict:
    """The checkpoint at rank 0's `path` on every rank, on the CPU: read by each where every rank sees the file (one
    machine, a shared disk), else read by rank 0 and sent (another machine of a run started by hand, --nnodes)."""
    if all_reduce_sum([float(not os.path.isfile(path))], ctx)[0] == 0:
        return load_file(path, map_location="cpu")
    sent = None
    if ctx.is_main:
        try:
            sent = {"payload": load_file(path, map_location="cpu")}
        except CheckpointError as e:  # said on every rank, none left waiting for the payload
            sent = {"error": str(e)}
    sent = broadcast_from_main(sent, ctx)
    if "error" in sent:
        raise CheckpointError(sent["error"])
    return sent["payload"]


def barrier(ctx: DistContext) -> None:
    if ctx.distributed and dist.is_initialized():
        dist.barrier()


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
