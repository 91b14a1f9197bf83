"""One trial of a sweep: its slot (cards, or CPU processes, no other gpuflow run holds) and the trial itself, one
job of flows/job.py on that slot (a script's in the working folder of flows/trialfolder.py), its per-epoch metric
reported to Optuna's pruner as it arrives.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuflow.tasks.devices.assign import assign_devices_for, check_inherited, explicit_ids, why_not
from gpuflow.tasks.devices.cards import CardLocks
from gpuflow.tasks.devices.probe import EnvironmentReport, probe_environment, usable_cpu_ids
from gpuflow.tasks.child import Stopped
from gpuflow.tasks.tracking import tracked
from gpuflow.training.contract import RunFolder

from .calls import admit, validated
from .job import Placement, run_job
from .launchers import Script, Worker, own_metrics
from .params import Devices, PipelineParams, ScriptParams, SweepParams
from .space import SweepError, with_values
from .trialfolder import TrialFolder, stores

STORE_EVERY_S = 1.0  # a trial's values reach the study at most this often (each is a database write), all at its end


@dataclass
class Slot:
    """The devices of one trial: explicit cards ('3,1,'), or a CPU slot: its cores, each held by its lock."""

    label: str
    gpus: str
    processes: int = 0  # on the CPU: the trial's DDP processes
    cards: tuple[int, ...] = ()
    cores: int = 0  # on the CPU: the host's cores its processes share
    lock: CardLocks | None = None


class Slots:
    """Trials' devices: groups of `gpus_per_trial` cards no other gpuflow run holds (the card locks decide), or on a
    host without a GPU, CPU slots of the cores this process may use / parallel (`<host>-cpu<core id>.lock`); one
    held elsewhere is never given: the sweep waits."""

    def __init__(self, params: SweepParams, report: EnvironmentReport, probe=probe_environment):
        check_inherited(report, params.gpus)
        if params.gpus not in ("auto", "cpu"):  # refused as `gpuflow run` would; busy ones are waited for
            assign_devices_for(report, Devices(gpus=params.gpus, skip_busy=False), batch_size=None)
        self.probe = probe
        visible = report.visible_physical_ids()
        self.gpu = bool(visible) and params.gpus != "cpu"
        if not self.gpu:
            refuse_gpus_on_the_cpu(params, "gpus=cpu" if params.gpus == "cpu" else "this host has no usable GPU")
        self.per_trial = params.gpus_per_trial if self.gpu else (params.cpu_processes or 1)
        if self.gpu:
            named = explicit_ids(params.gpus)
            self.pool = named or visible
            # a run skips busy cards it picks itself, never cards the user named: the same here
            self.rule = Devices(skip_busy=params.skip_busy and not named, min_free_mb=params.min_free_mb)
            if not named:  # too few cards pass the rule (busy, short of memory) whoever holds them: a run's error
                assign_devices_for(report, self.rule.model_copy(update={"gpus": str(self.per_trial)}), batch_size=None)
            cards = int(params.gpus) if params.gpus.isdigit() else len(self.pool)  # a count: at most that many at once
            capacity = cards // self.per_trial
            what = f"{cards} GPUs ({params.gpus_per_trial} per trial)"
        else:
            capacity = report.cpu_count // self.per_trial
            what = f"{report.cpu_count} CPUs ({self.per_trial} process(es) per trial)"
        if capacity < 1:
            raise SweepError(f"gpus_per_trial={self.per_trial} is more than the {what}; ask for fewer per trial")
        self.parallel = capacity if params.parallel == "auto" else int(params.parallel)
        if self.parallel > capacity:
            raise SweepError(f"parallel={params.parallel} trials do not fit on {what}: at most {capacity} "
                             "run at a time; lower parallel or gpus_per_trial")
        if not self.gpu:  # each trial its share of the host's cores, all used however few run at a time
            self.cores = report.cpu_count // self.parallel
            self.pool = list(range(self.parallel))
            # locked by core id: sweeps in disjoint cpusets never wait for each other, overlapping ones share
            self.cpu_ids = usable_cpu_ids()  # the report's cpu_count is their number
        self.busy: set[int] = set()
        self._mutex = threading.Lock()

    def take(self) -> Slot | None:
        """A free slot, or None while every one is in use here or held by another run."""
        with self._mutex:
            return self._take_gpus() if self.gpu else self._take_cpu()

    def _take_cpu(self) -> Slot | None:
        for k in self.pool:
            if k in self.busy:
                continue
            lock = CardLocks(ranks_wait_s=0)  # a lock per core: sweeps of other slot sizes share the host too
            if all(lock.try_lock(f"{socket.gethostname()}-cpu{c}")
                   for c in self.cpu_ids[k * self.cores:(k + 1) * self.cores]):
                self.busy.add(k)
                return Slot(f"cpu{k}", "cpu", self.per_trial, (k,), self.cores, lock)
            lock.release()
        return None

    def _take_gpus(self) -> Slot | None:
        """Cards free by the rule a run's assignment applies (skip_busy, min_free_mb, other runs' locks),
        on a fresh probe: cards fill and empty while a sweep runs."""
        report = self.probe()
        held = CardLocks(ranks_wait_s=0).held_elsewhere(report)
        by_id = {g.index: g for g in report.gpus}
        free = [i for i in self.pool if i not in self.busy and i in by_id
                and why_not(by_id[i], self.rule, held) is None]
        if len(free) < self.per_trial:
            return None
        cards = tuple(free[:self.per_trial])
        self.busy.update(cards)
        return Slot("gpu" + ",".join(map(str, cards)), ",".join(map(str, cards)) + ",", 0, cards)

    def give_back(self, slot: Slot) -> None:
        with self._mutex:
            if slot.lock is not None:
                slot.lock.release()
            self.busy.difference_update(slot.cards)


def refuse_gpus_on_the_cpu(params: SweepParams, why: str) -> None:
    """Trials on the CPU that were asked for several GPUs each, with no word of their processes: refused, as `gpuflow
    run --gpus 2` is on such a host (most likely CUDA is not visible here: hours on the CPU would tell no one)."""
    if params.gpus_per_trial > 1 and not params.cpu_processes:
        raise SweepError(f"gpus_per_trial={params.gpus_per_trial} asks for GPUs but the trials run on the CPU ({why}); "
                         f"for {params.gpus_per_trial} gloo processes per trial use cpu_processes="
                         f"{params.gpus_per_trial} (--cpu-processes), or run where the GPUs are visible")


@dataclass
class Trial:
    """A trial on its way: the Optuna trial, its slot, the values and how it is stopped."""

    trial: Any
    slot: Slot
    values: dict
    stop: threading.Event = field(default_factory=threading.Event)
    pruning: Any = None  # study.Pruning: whether its values so far are pruned
    reported: dict[int, float] = field(default_factory=dict)  # step: the optimized metric, as reported
    stored: set[int] = field(default_factory=set)  # the steps written to the study so far
    stored_at: float = 0.0
    pruned_at: int | None = None
    missing: list[str] | None = None
    run_id: str | None = None
    result: dict | None = None  # rank 0's, once it finished: what registering it needs

    def store(self) -> None:
        """The values reported since the last call, written to the study (a database write per value)."""
        for step in sorted(self.reported.keys() - self.stored):
            self.trial.report(self.reported[step], step)
            self.stored.add(step)
        self.stored_at = time.monotonic()


def reporter(t: Trial, params: SweepParams, metric: str):
    """The trial's per-epoch report to Optuna: pruned (its launch stopped) when the pruner says so. Without a
    pruner nothing decides on the values: the study keeps the trial's final value alone (its run, every epoch's)."""

    def report(step: int, metrics: dict) -> None:
        if t.stop.is_set():  # decided (or the sweep stops): the lines still arriving change nothing
            return
        if metric not in metrics:
            t.missing = sorted(k for k in metrics if k.startswith("val_"))
            t.stop.set()
            return
        if params.pruner == "none":
            return
        t.reported[step] = metrics[metric]
        if time.monotonic() - t.stored_at >= STORE_EVERY_S:  # the pruner decides on `reported` meanwhile
            t.store()
        if t.pruning.says(t.trial.number, t.reported):
            t.pruned_at = step
            t.stop.set()

    return report


def run_trial(t: Trial, params: SweepParams, parent_id: str, metric: str, study_name: str,
              folder: TrialFolder | None = None) -> float | None:
    """One trial as one job on its slot, nested under the sweep's run, its metric reported to the pruner as it
    arrives (a script's in its own working folder, as `folder` plans it); the metric's final value, or None when
    pruned (run FINISHED, tagged sweep.pruned)."""
    name = f"{study_name}-t{t.trial.number}"
    slot = {"gpus": t.slot.gpus, "cpu_processes": t.slot.processes, "cpu_cores": t.slot.cores, "run_name": name}
    model, values = ((ScriptParams, params.script_params(t.values)) if params.script
                     else (PipelineParams, with_values(params.pipeline(), t.values)))
    trial_params = admit(validated(model, values | slot))  # the space's values pass the door as the sweep's did
    if params.script:
        launcher, plan = Script(trial_params), folder or TrialFolder.of(Path.cwd(), params.collect, stores(params))
        cwd = lambda run: plan.make(RunFolder(run.workdir).work)  # noqa: E731
    else:
        launcher, cwd = Worker(trial_params), None

    runs: list[tracked.TrackedRun] = []  # the trial's, once open: its client reads what a script logged

    def opened(run: tracked.TrackedRun) -> None:
        runs.append(run)
        t.run_id = run.run_id
        t.trial.set_user_attr("mlflow_run_id", run.run_id)

    def stopped(run: tracked.TrackedRun) -> None:
        if t.missing is not None:
            raise SweepError(f"optimize={metric!r}: the trial's epochs report no such metric (they "
                             f"report {', '.join(t.missing)}); use one of those")
        if t.pruned_at is None:
            raise Stopped()  # the sweep is being stopped
        run.client.set_tag(run.run_id, "sweep.pruned", f"after epoch {t.pruned_at}")

    tags = {"mlflow.parentRunId": parent_id, "sweep.study": study_name, "sweep.trial": t.trial.number,
            "sweep.slot": t.slot.label}
    done = run_job(launcher, Placement(slot=False, name=name, register=False, tags=tags, stop=t.stop,
                                       on_metrics=reporter(t, params, metric), metric=metric, cwd=cwd, on_run=opened,
                                       on_stopped=stopped, system_metrics=False, checkpoint_each_epoch=False))
    if done.get("stopped"):
        return None
    t.result = done
    # a script's metrics as the run has them (it may log them itself)
    final = done.get("final_metrics") or runs[0].client.get_run(done["run_id"]).data.metrics
    if metric not in final:
        raise SweepError(f"optimize={metric!r}: the trial logged no such metric (it logged "
                         f"{', '.join(own_metrics(final)) or 'none'}); report it with helper.report or "
                         "mlflow.log_metric, or optimize one of those")
    return float(final[metric])
