"""Device assignment: a request plus an EnvironmentReport gives a DevicePlan, or a clear error.

Users name physical GPUs (nvidia-smi numbering); the child sees them as logical 0..n-1, 0 the primary card.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Literal

from prefect import task
from pydantic import BaseModel

from gpuflow.training.config import FP16_NEEDS_CUDA, batch_split
from gpuflow.training.errors import UserError

from .cards import CardLocks
from .probe import EnvironmentReport, GpuInfo, cvd_refusal, usable_cpus

if TYPE_CHECKING:  # the request: the flows' parameters
    from gpuflow.flows.params import Devices


class AssignmentError(UserError):
    """The request cannot be met on this host; the message names the value and the fix."""


GPUS_HELP = ("auto (all free GPUs, else CPU), cpu, a count like '2', or physical ids in order "
             "like '3,2,0,1' (the first is the primary card; '3,' is GPU 3 alone)")


def parse_gpus(v: str) -> str:
    """The `gpus` grammar, checked; raises ValueError naming the fix."""
    v = str(v).strip().replace(" ", "")
    if v == "0":
        raise ValueError("gpus=0 asks for no GPU; use gpus=cpu to train on the CPU")
    if v in ("auto", "cpu") or v.isdigit():
        return v
    parts = [p for p in v.split(",") if p]  # '3,' names physical GPU 3 alone
    if not parts or not all(p.isdigit() for p in parts):
        raise ValueError(f"gpus={v!r} is not understood; use auto, cpu, a count like 2, or physical ids like 3,2")
    dup = sorted({p for p in parts if parts.count(p) > 1})
    if dup:
        raise ValueError(f"gpus={v!r} names GPU {', '.join(dup)} twice; list each card once")
    return v


def one_device(v: str) -> str:
    """The `gpus` grammar for a step that uses one device (evaluate, infer, a retrain's comparison)."""
    gpus = parse_gpus(v)
    ids = explicit_ids(gpus)
    if (ids is not None and len(ids) > 1) or (gpus.isdigit() and int(gpus) > 1):
        hint = f"; to name physical GPU {gpus}, write '{gpus},'" if gpus.isdigit() else ""
        raise AssignmentError(f"gpus={gpus} asks for several devices but this step uses one; "
                              f"name one card ('3,'), ask for '1', or use cpu{hint}")
    return gpus


def explicit_ids(gpus: str) -> list[int] | None:
    return [int(p) for p in gpus.split(",") if p] if "," in gpus else None


def check_host(params) -> None:
    """Refuse values this host's CPUs or memory cannot meet; called where the job runs, as validation may not be."""
    cores = usable_cpus()
    for name in ("cpu_processes", "cpu_cores", "num_workers"):
        if (value := getattr(params, name, 0)) > cores:
            raise AssignmentError(f"{name}={value} is more than the {cores} CPUs this process may use here; "
                                  f"use at most {cores} (0 = auto)")
    if getattr(params, "dataset", None) == "synthetic":
        need = params.synthetic_size * params.synthetic_side ** 2 * 4  # float32, one channel, per process
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if need > ram // 2:
            raise AssignmentError(f"synthetic_size={params.synthetic_size} at synthetic_side={params.synthetic_side} "
                                  f"needs {need / 2**30:.1f} GiB per process, more than half of this host's "
                                  f"{ram / 2**30:.0f} GiB; lower synthetic_size or synthetic_side")


class DevicePlan(BaseModel):
    strategy: Literal["single", "dp", "ddp"]
    backend: Literal["nccl", "gloo"]
    device: Literal["cpu", "cuda"]
    nproc_per_node: int
    physical_ids: list[int] = []
    uuids: list[str] = []
    logical_ids: list[int] = []
    physical_to_logical: dict[int, int] = {}
    primary: int | None = None
    env: dict[str, str] = {}
    cpu_threads: int | None = None  # each process's OMP_NUM_THREADS on a shared CPU host (None: torch's default)
    warnings: list[str] = []

    def describe(self) -> str:
        if self.device == "cpu":
            return f"cpu x{self.nproc_per_node}"
        return "gpu " + ",".join(map(str, self.physical_ids))


def _cpu_plan(report: EnvironmentReport, req: Devices) -> DevicePlan:
    if req.strategy == "dp":
        raise AssignmentError("strategy 'dp' (nn.DataParallel) needs GPUs and this host has none "
                              "usable; use strategy 'ddp' (gloo) or 'single' on CPU")
    if req.backend == "nccl":
        raise AssignmentError("backend 'nccl' needs GPUs and this host has none usable; use 'gloo'")
    nproc = req.cpu_processes or (2 if report.cpu_count >= 2 else 1)
    strategy = req.strategy if req.strategy != "auto" else ("ddp" if nproc > 1 else "single")
    if strategy == "single":
        nproc = 1
    cores = req.cpu_cores or report.cpu_count  # shared by the processes: more threads than cores is contention
    return DevicePlan(strategy=strategy, backend="gloo", device="cpu", nproc_per_node=nproc,
                      env={"CUDA_VISIBLE_DEVICES": ""},
                      cpu_threads=max(1, cores // nproc) if nproc > 1 or cores < report.cpu_count else None)


def why_not(g: GpuInfo, req: Devices, locked: set[int]) -> str | None:
    """Why a card is not free for a request (held by a gpuflow run, busy, short of memory), or None."""
    if g.index in locked:
        return "in use by another gpuflow run"
    if req.skip_busy and g.processes:
        return f"busy ({g.processes} other processes)"
    if g.memory_free_mb < req.min_free_mb:
        return f"{g.memory_free_mb} MiB free < min_free_mb {req.min_free_mb}"
    return None


def _choose(report: EnvironmentReport, req: Devices, locked: set[int]) -> list[GpuInfo]:
    by_id = {g.index: g for g in report.gpus}
    visible = report.visible_physical_ids()
    ids = explicit_ids(req.gpus)
    if ids is not None:
        return [_check_explicit(i, by_id, visible, report, req, locked) for i in ids]
    pool = [by_id[i] for i in visible]
    free = [g for g in pool if why_not(g, req, locked) is None]
    free.sort(key=lambda g: (-g.memory_free_mb, g.index))
    want = len(free) if req.gpus == "auto" else int(req.gpus)
    if want > len(pool):
        raise AssignmentError(
            f"gpus={req.gpus} asks for {want} GPUs but this process can use {len(pool)} "
            f"(physical {', '.join(map(str, visible)) or 'none'}); ask for at most {len(pool)}")
    if want == 0 or len(free) < want:
        reasons = "; ".join(f"GPU {g.index}: {why_not(g, req, locked)}" for g in pool if g not in free)
        raise AssignmentError(
            f"gpus={req.gpus} needs {want or 'at least one'} free GPU(s) but only {len(free)} "
            f"are free ({reasons}); wait, lower min_free_mb, set skip_busy=false, or use gpus=cpu")
    return free[:want]


def _check_explicit(i: int, by_id: dict, visible: list[int], report: EnvironmentReport,
                    req: Devices, locked: set[int]) -> GpuInfo:
    if i not in by_id:
        present = ", ".join(map(str, sorted(by_id))) or "none"
        raise AssignmentError(f"physical GPU {i} does not exist on {report.hostname}; "
                              f"present: {present} (nvidia-smi numbering)")
    if i not in visible:
        raise AssignmentError(
            f"physical GPU {i} is hidden by the inherited CUDA_VISIBLE_DEVICES="
            f"{report.cuda_visible_devices!r}; usable here: {', '.join(map(str, visible)) or 'none'}. "
            "Pick one of those or unset CUDA_VISIBLE_DEVICES before starting gpuflow")
    g = by_id[i]
    if i in locked:
        raise AssignmentError(f"physical GPU {i} is in use by another gpuflow run; wait for it "
                              "or pick another card")
    if g.memory_free_mb < req.min_free_mb:
        raise AssignmentError(f"physical GPU {i} has {g.memory_free_mb} MiB free, below "
                              f"min_free_mb={req.min_free_mb}; pick another card or lower it")
    return g


def assign_devices_for(report: EnvironmentReport, req: Devices, batch_size: int | None,
                       precision: str = "fp32", locked: set[int] = frozenset()) -> DevicePlan:
    """Pure assignment: validate everything that can be checked before launch."""
    check_host(req)
    check_inherited(report, req.gpus)
    no_gpu = not report.visible_physical_ids()
    if req.gpus == "cpu" or (req.gpus == "auto" and no_gpu):
        plan = _cpu_plan(report, req)
    else:
        if no_gpu:
            raise AssignmentError(
                f"gpus={req.gpus} asks for GPUs but none are usable on {report.hostname} "
                f"(present: {', '.join(str(g.index) for g in report.gpus) or 'none'}, "
                f"CUDA_VISIBLE_DEVICES={report.cuda_visible_devices or 'unset'}); use gpus=cpu")
        plan = _gpu_plan(report, req, _choose(report, req, locked))
    _check_batch_and_precision(plan, report, batch_size, precision)
    return plan


def _gpu_plan(report: EnvironmentReport, req: Devices, cards: list[GpuInfo]) -> DevicePlan:
    n = len(cards)
    strategy = req.strategy if req.strategy != "auto" else ("single" if n == 1 else "ddp")
    if strategy == "single" and n > 1:
        raise AssignmentError(f"strategy 'single' uses one GPU but gpus={req.gpus} gives {n}; "
                              "use strategy dp or ddp, or ask for one card")
    ids = [g.index for g in cards]
    warnings = [f"GPU {g.index} already runs {g.processes} other process(es)" for g in cards if g.processes]
    return DevicePlan(
        strategy=strategy, backend="gloo" if req.backend == "gloo" else "nccl", device="cuda",
        nproc_per_node=n if strategy == "ddp" else 1, physical_ids=ids,
        uuids=[g.uuid for g in cards], logical_ids=list(range(n)),
        physical_to_logical={p: l for l, p in enumerate(ids)}, primary=ids[0],
        env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))},
        warnings=warnings,
    )


def _check_batch_and_precision(plan: DevicePlan, report: EnvironmentReport, batch: int | None, precision: str) -> None:
    n = len(plan.physical_ids) if plan.device == "cuda" else plan.nproc_per_node
    if batch is not None and plan.strategy in ("dp", "ddp") and (  # None: a script's own batch
            why := batch_split(batch, n, f"devices of this {plan.strategy} plan",
                               plan.nproc_per_node if plan.strategy == "ddp" else None)):
        raise AssignmentError(why)
    if precision == "fp16" and plan.device == "cpu":
        raise AssignmentError(FP16_NEEDS_CUDA)
    if precision == "bf16" and plan.device == "cuda":
        old = [g for g in report.gpus if g.index in plan.physical_ids and not g.bf16]
        if old:
            raise AssignmentError(f"precision 'bf16' needs compute capability >= 8.0 but GPU "
                                  f"{old[0].index} ({old[0].name}) has {old[0].compute_capability}; "
                                  "use 'fp16' or 'fp32'")
        if plan.strategy == "dp" and n > 1:  # torch/nn/parallel/parallel_apply.py: autocast(enabled=...) alone
            raise AssignmentError(f"precision 'bf16' with strategy 'dp' on {n} GPUs: nn.DataParallel's replicas run "
                                  "autocast in its default fp16 whatever the dtype, so they would train in fp16 "
                                  "without a loss scaler; use strategy 'ddp' (one process per GPU), or 'fp16'")


def check_inherited(report: EnvironmentReport, gpus: str) -> None:
    """Refuse an inherited CUDA_VISIBLE_DEVICES whose cards gpuflow cannot use, unless the run asked for the CPU
    (it would otherwise go to the CPU without a word)."""
    if gpus != "cpu" and (why := cvd_refusal(report.cuda_visible_devices, report.gpus)):
        raise AssignmentError(f"the inherited CUDA_VISIBLE_DEVICES={report.cuda_visible_devices!r} {why}; or use "
                              "gpus=cpu")


def one_device_plan(report: EnvironmentReport, request: Devices) -> DevicePlan:
    """One device for evaluation or inference: `request.gpus` auto (the freest GPU, else the CPU), '1' (the freest
    GPU), '3,', cpu; the request's strategy single, one process."""
    gpus = one_device(request.gpus)
    check_inherited(report, gpus)
    if gpus == "auto":
        gpus = "1" if report.visible_physical_ids() else "cpu"
    request = request.model_copy(update={"gpus": gpus, "strategy": "single", "cpu_processes": 1})
    return assign_devices_for(report, request, batch_size=1, locked=CardLocks().held_elsewhere(report))


@task(name="assign-devices")
def assign_devices(report: EnvironmentReport, request: Devices, batch_size: int | None,
                   precision: str = "fp32") -> DevicePlan:
    """Turn a device request into a validated DevicePlan (cards locked by others are avoided)."""
    return assign_devices_for(report, request, batch_size, precision, locked=CardLocks().held_elsewhere(report))
