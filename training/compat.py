"""Workarounds of other projects' bugs and gaps, each with its upstream issue, in one place;
tests/test_compat.py says when each can go (it fails on the torch release to check again).

pytorch#167288: after a torchrun restart the agent's shared rendezvous TCPStore still holds the
    previous attempt's addresses, and a restarted rank dialled a dead peer ("Connection refused").
    Both halves: a fresh store per attempt on every torchrun gpuflow starts (FRESH_RDZV_STORE), and
    gpuflow's own worker keys its process group by attempt (attempt_store).
No public default collective timeout (pytorch/pytorch#84939's discussion): a user's script that calls
    init_process_group() without a timeout gets the run's --dist-timeout-s through c10d's module
    defaults, which is what init_process_group reads (set_default_pg_timeout).
"""

from __future__ import annotations

from datetime import timedelta

CHECKED_WITH_TORCH = (2, 14)  # the release these were last checked against (tests/test_compat.py)
FRESH_RDZV_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # pytorch#167288


def attempt_store(store, attempt: int | str):
    """The env:// store under a key prefix unique to this torchrun attempt (pytorch#167288)."""
    import torch.distributed as dist

    return dist.PrefixStore(f"gpuflow/attempt-{attempt}", store)


def set_default_pg_timeout(seconds: float) -> None:
    """The collective timeout a script's init_process_group() takes when it names none."""
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timedelta(seconds=seconds)
