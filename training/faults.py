"""Test-only fault injection for the worker: kill a rank at a chosen point (GPUFLOW_FAULT)."""

from __future__ import annotations

import os

from .contract import ranks


def fault_hook(spec: str | None):
    """f(rank, epoch, step) that kills the process at the point `spec` names, or None when unset.

    spec: 'rank=1,epoch=2,restart=0[,step=N][,once=PATH]'; with `once`, only while PATH does not exist (it is
    created first), so a fresh launch after it succeeds.
    """
    if not spec:
        return None
    fields = dict(kv.split("=", 1) for kv in spec.split(","))
    once = fields.pop("once", None)
    want = {k: int(v) for k, v in fields.items()}

    def maybe_die(rank: int, epoch: int, step: int) -> None:
        if (rank, epoch, ranks().restarts, step) != (want.get("rank", 0), want.get("epoch", 1),
                                            want.get("restart", 0), want.get("step", 1)):
            return
        if once:
            try:
                open(once, "x").close()
            except FileExistsError:
                return
        print(f"[rank {rank}] injected fault at epoch {epoch} step {step}", flush=True)
        os._exit(17)

    return maybe_die
