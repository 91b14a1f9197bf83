"""Workarounds of other projects' bugs and gaps, each with its upstream issue; tests/test_rules.py fails on
a newer torch release, to check each again.

pytorch#167288: after a torchrun restart the shared rendezvous TCPStore keeps the previous attempt's addresses
    ("Connection refused"): a fresh store per attempt (FRESH_RDZV_STORE), a group keyed by attempt (attempt_store).
pytorch/pytorch#84939 (no public default collective timeout): a script's init_process_group() without a timeout
    gets --dist-timeout-s through c10d's module defaults (set_default_pg_timeout).
"""

from __future__ import annotations

from datetime import timedelta

CHECKED_WITH_TORCH = (2, 14)  # the release these were last checked against (tests/test_rules.py)
FRESH_RDZV_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # pytorch#167288


def attempt_store(store, attempt: int | str):
    """The env:// store under a key prefix unique to this torchrun attempt (pytorch#167288)."""
    import torch.distributed as dist

    return dist.PrefixStore(f"gpuflow/attempt-{attempt}", store)


def set_default_pg_timeout(seconds: float) -> None:
    """The collective timeout a script's init_process_group() takes when it names none."""
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timedelta(seconds=seconds)
