"""Process-group setup from the environment torchrun sets; never from arguments. The collectives send tensors
only, decoded as JSON, raw numbers or a weights_only checkpoint: a hostile rendezvous store can hand a rank to an
attacker, and what that rank sends must never be unpickled."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from .checkpoint import CheckpointError, load_bytes, load_file
from .config import FP16_NEEDS_CUDA, TrainConfig, batch_split
from .compat import attempt_store
from .contract import ranks
from .errors import UserError


class LaunchError(UserError):
    """The process was started in a way that cannot work; the message says how to start it."""


class CollectiveError(UserError):
    """Another rank sent what this rank's collective cannot read as the value it expects; the message names it."""


# what a rank that speaks another protocol than this group's ranks most likely is
STRANGER = ("a process that is not this run's (or a hostile one) joined its rendezvous store; check who can reach "
            "the store's address, or give the run a store of its own")


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


def broadcast_from_main(obj, ctx: DistContext):
    """Rank 0's `obj`, a JSON value (None, a str, a dict of str to float, ...), on every rank: sent as UTF-8 JSON in
    a tensor and read with json.loads, so what a peer sends is never unpickled. Rank 0 keeps its own `obj`."""
    if not ctx.distributed:
        return obj
    text = _broadcast_bytes(json.dumps(obj).encode() if ctx.is_main else None, ctx)
    if ctx.is_main:
        return obj
    try:
        return json.loads(text.decode())
    except (ValueError, RecursionError):  # UnicodeDecodeError too; or nested past the parser: not this run's rank 0
        raise CollectiveError(f"rank 0 sent {len(text)} bytes that are not JSON ({text[:32]!r}...): "
                              f"{STRANGER}") from None


def load_on_every_rank(path: str, ctx: DistContext) -> dict:
    """The checkpoint at rank 0's `path` on every rank, on the CPU: read by each where every rank sees the file (one
    machine, a shared disk), else read by rank 0, whose file's bytes every rank loads as it would the file (another
    machine of a run started by hand, --nnodes)."""
    if all_reduce_sum([float(not os.path.isfile(path))], ctx)[0] == 0:
        return load_file(path, map_location="cpu")
    payload, data, error = None, None, None
    if ctx.is_main:
        try:
            payload, data = _read_on_main(path)
        except CheckpointError as e:  # said on every rank, none left waiting for the bytes
            error = str(e)
    if (error := broadcast_from_main(error, ctx)) is not None:
        raise CheckpointError(str(error))
    data = _broadcast_bytes(data, ctx)
    return payload if ctx.is_main else load_bytes(data, f"{path} (sent by rank 0)")


def _read_on_main(path: str) -> tuple[dict, bytes]:
    """Rank 0's checkpoint and its file's bytes, read once: the other ranks load exactly what rank 0 does."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        load_file(path)  # raises what a lone process says of it (it does not exist, ...)
        why = f"checkpoint {path!r} cannot be read on rank 0 ({e.strerror}); check the resume path"
        raise CheckpointError(why) from None
    return load_bytes(data, path), data


def _broadcast_bytes(data: bytes | None, ctx: DistContext) -> bytes:
    """Rank 0's `data` on every rank: its length, then its bytes, as tensors on ctx.device (NCCL's are a card's)."""
    if not ctx.distributed:
        return data
    size = torch.tensor([len(data) if ctx.is_main else 0], dtype=torch.int64, device=ctx.device)
    dist.broadcast(size, src=0)
    if (n := int(size.item())) < 0:
        raise CollectiveError(f"rank 0 sent a length of {n} bytes: {STRANGER}")
    if n == 0:
        return b""
    buf = _as_tensor(data, ctx.device) if ctx.is_main else torch.empty(n, dtype=torch.uint8, device=ctx.device)
    dist.broadcast(buf, src=0)
    return data if ctx.is_main else buf.cpu().numpy().tobytes()


def _as_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)  # bytearray: frombuffer wants it writable


def gather_to_main(obj, ctx: DistContext) -> list | None:
    """Every rank's `obj` (a tensor, or nested tuples/lists/dicts of tensors and None), as a list in rank order on
    rank 0; None elsewhere. Each tensor travels as its shape and raw bytes, rebuilt in rank 0's own structure and
    dtypes: a rank whose structure differs is an error on every rank, and nothing a peer sends is unpickled."""
    if not ctx.distributed:
        return [obj]
    _check_alike(obj, ctx)
    leaves = [t.detach().cpu() for t in _leaves(obj)]
    if not leaves:
        return [obj] * ctx.world_size if ctx.is_main else None
    every_shape = _all_gather_shapes(leaves, ctx)
    sizes = [[math.prod(s) * t.element_size() for s, t in zip(shapes, leaves)] for shapes in every_shape]
    longest = max(sum(s) for s in sizes)  # every rank sends as many bytes: gather's tensors are of one size
    padding = torch.zeros(longest - sum(sizes[ctx.rank]), dtype=torch.uint8)
    mine = torch.cat([t.reshape(-1).view(torch.uint8) for t in leaves] + [padding]).to(ctx.device)
    got = [torch.empty_like(mine) for _ in range(ctx.world_size)] if ctx.is_main else None
    if longest:  # all empty: nothing to send
        dist.gather(mine, got, dst=0)
    if not ctx.is_main:
        return None
    return [obj] + [_rebuild(obj, iter(_unpack(got[r].cpu(), leaves, every_shape[r], sizes[r])))
                    for r in range(1, ctx.world_size)]


def _structure(obj) -> object:
    """`obj`'s nesting, its tensors' dtypes and dims, as JSON: what every rank's value must share with rank 0's."""
    if isinstance(obj, torch.Tensor):
        return [str(obj.dtype).removeprefix("torch."), obj.dim()]
    if isinstance(obj, dict):
        return {"dict": [[repr(k), _structure(v)] for k, v in obj.items()]}
    if isinstance(obj, (tuple, list)):
        return {type(obj).__name__: [_structure(v) for v in obj]}
    return None if obj is None else type(obj).__name__


def _check_alike(obj, ctx: DistContext) -> None:
    """Raise on every rank (none left waiting) when a rank's value differs from rank 0's in its structure, or when
    they hold more than tensors. Each rank sends a digest of its own structure: nothing of it is read but that."""
    own = json.dumps(_structure(obj))
    digest = int.from_bytes(hashlib.blake2b(own.encode(), digest_size=8).digest(), "big", signed=True)
    every = [torch.empty(1, dtype=torch.int64, device=ctx.device) for _ in range(ctx.world_size)]
    dist.all_gather(every, torch.tensor([digest], dtype=torch.int64, device=ctx.device))
    if unlike := [r for r, d in enumerate(every) if int(d.item()) != int(every[0].item())]:
        raise CollectiveError(f"ranks {unlike} of {ctx.world_size} gather values unlike rank 0's (rank {ctx.rank}'s "
                              f"nesting, dtypes and dims: {own[:200]}); every rank must hold the same kind of value")
    if others := _non_tensors(obj):  # the same on every rank: each one's structure is rank 0's
        raise CollectiveError(f"gather_to_main sends tensors (in tuples, lists, dicts) and None only; the value "
                              f"holds {', '.join(sorted(set(others)))}")


def _non_tensors(obj) -> list[str]:
    if isinstance(obj, dict):
        return [n for v in obj.values() for n in _non_tensors(v)]
    if isinstance(obj, (tuple, list)):
        return [n for v in obj for n in _non_tensors(v)]
    return [] if obj is None or isinstance(obj, torch.Tensor) else [type(obj).__name__]


def _leaves(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    return [t for v in values for t in _leaves(v)]


def _rebuild(obj, leaves):
    """`obj`'s structure with the next of `leaves` in place of each of its tensors."""
    if isinstance(obj, torch.Tensor):
        return next(leaves)
    if isinstance(obj, dict):
        return type(obj)((k, _rebuild(v, leaves)) for k, v in obj.items())
    if isinstance(obj, (tuple, list)):
        return type(obj)(_rebuild(v, leaves) for v in obj)
    return obj


def _all_gather_shapes(leaves: list[torch.Tensor], ctx: DistContext) -> list[list[tuple[int, ...]]]:
    """Every rank's shape of each leaf (their dims are rank 0's, checked); a negative size is an error on all."""
    flat = torch.tensor([n for t in leaves for n in t.shape], dtype=torch.int64, device=ctx.device)
    every = [torch.empty_like(flat) for _ in range(ctx.world_size)]
    if flat.numel():
        dist.all_gather(every, flat)
    shapes = []
    for rank, sent in enumerate(every):
        sizes = iter(sent.tolist() if flat.numel() else [])
        shapes.append([tuple(next(sizes) for _ in range(t.dim())) for t in leaves])
        if any(n < 0 for s in shapes[-1] for n in s):
            raise CollectiveError(f"rank {rank} sent tensor shapes {shapes[-1]} with a negative size: {STRANGER}")
    return shapes


def _unpack(buf: torch.Tensor, leaves: list[torch.Tensor], shapes: list[tuple], sizes: list[int]):
    """A peer's tensors from its bytes, in the dtypes of rank 0's `leaves` (clone: a view needs aligned storage)."""
    offsets = [0, *itertools.accumulate(sizes)]
    return [buf[a:b].clone().view(t.dtype).reshape(s) for a, b, t, s in zip(offsets, offsets[1:], leaves, shapes)]


def barrier(ctx: DistContext) -> None:
    if ctx.distributed and dist.is_initialized():
        dist.barrier()


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
