"""The sweep flow: Optuna samples and prunes trials (flows/trial.py), each a job of the training session nested under
one parent MLflow run, in a kept study (flows/study.py); the best trial's model is registered and promoted only if
it beats the champion. docs/sweeps.md has the space file's format and script sweeps.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextvars import copy_context
from pathlib import Path

from prefect import get_run_logger
from prefect.runtime import flow_run

from gpuflow.tasks.devices.slot import device_slot
from gpuflow.tasks.devices.probe import probe_environment
from gpuflow.tasks.tracking import orphans, results, store, tracked
from gpuflow.training.contract import RunFolder
from gpuflow.training.judged import mode_of, monitored
from gpuflow.training.uris import shown

from .allow import current_policy
from .calls import one_line
from .champion import compare_with_champion, offer_unevaluated
from .job import parent_run
from .launchers import Script, unregistrable
from .checked import checked_flow
from .params import SweepParams
from .space import Distribution, SweepError, read_space
from .study import (HEARTBEAT_S, Kept, best_so_far, counted, open_study, storage_url,
                    plots_beside, study_name, summarize, sweep_run)
from .trial import Slot, Slots, Trial, run_trial
from .trialfolder import TrialFolder, stores

CONSECUTIVE_FAILURES = 3  # trials failing in a row stop the sweep: the next would fail the same way


def objective_target(params: SweepParams) -> tuple[str, str]:
    """(the metric the trials report and the sweep optimizes, minimize or maximize)."""
    # a script's metric is its own (required): its direction by its name, higher unless a loss
    monitor, mode = ("", "max") if params.script else monitored(params.objective, str(Path.cwd()))
    metric = params.optimize if params.optimize != "auto" else f"val_{monitor}"
    if params.direction != "auto":
        return metric, params.direction
    return metric, "minimize" if mode_of(metric, monitor, mode) == "min" else "maximize"


def sweep_run_name() -> str:
    return study_name(flow_run.get_parameters())


@checked_flow(SweepParams, name="sweep", flow_run_name=sweep_run_name,
              on_crashed=[orphans.end_flow_run_mlflow_runs], on_cancellation=[orphans.end_flow_run_mlflow_runs])
def sweep(params: SweepParams) -> dict:
    """Search a run's parameters with Optuna: trials in parallel on separate cards, pruned early,
    nested under one MLflow run; the best trial registered and promoted if it beats the champion."""
    log = get_run_logger()
    space = read_space(params.space)  # checked already, with the other parameters (SweepParams)
    metric, direction = objective_target(params)
    slots = Slots(params, probe_environment())
    url = storage_url(params)
    if policy := current_policy():  # the stack's published URL is a Variable any API user may set
        policy.check_storage(url, params.tracking_uri)
    kept = open_study(params, metric, direction, url)
    study, name = kept.study, kept.study.study_name
    log.info("sweep %s: %d of %d trials done; %d at a time on %s; optimizing %s (%s); study in %s", name,
             counted(study), params.trials, slots.parallel, "GPUs" if slots.gpu else "CPU slots", metric, direction,
             shown(url))
    folder = None
    if params.script:  # read once: the trials' writes stay in their own folders
        folder = TrialFolder.of(Path.cwd(), params.collect, stores(params, url))
        log.info("sweep %s: %s", name, folder.describe())
    resume = study.user_attrs.get("mlflow_run_id")
    client = store.prepare_store(params.tracking_uri)
    if resume and not sweep_run(client, resume, name):
        log.warning("sweep %s: its study names MLflow run %r, which is not this sweep's run in %s (deleted, another "
                    "store's or another study's); a new run", name, str(resume)[:64], shown(client.tracking_uri))
        resume = None
    with parent_run(params, name, {"sweep.study": name, "sweep.storage": shown(url)}, resume) as parent:
        study.set_user_attr("mlflow_run_id", parent.run_id)
        parent.log_json({k: v.model_dump(exclude_none=True) for k, v in space.items()}, "space.json", "sweep")
        if not resume:
            parent.log_params({"sweep.trials": params.trials, "sweep.parallel": slots.parallel,
                               "sweep.pruner": params.pruner, "sweep.optimize": metric,
                               "sweep.direction": direction, "sweep.space": sorted(space)})
        results.warm_model_logging()  # the best trial is registered at the end: MLflow's one-time costs meanwhile
        with device_slot():  # one served run on this host's devices (its trials do not queue on it again)
            finished = run_trials(kept, space, params, slots, parent.run_id, metric, folder)
        summary = summarize(study, parent, metric)
        if summary.get("best_run_id"):
            summary |= register_best(params, client, summary, name, metric, finished.get(summary["best_run_id"]),
                                     plots_beside(study, parent))
            for k in ("model_version", "promoted"):
                parent.client.set_tag(parent.run_id, f"sweep.{k}", str(summary.get(k)))
        why = summary.pop("unregistered", None)
        if summary.get("model_version") is None:
            raise SweepError(f"sweep {name}: nothing registered: {unregistered(summary, why)}")
    log.info("sweep %s: %s", name, summary)
    return {"run_id": parent.run_id, "study": name, **summary}


def unregistered(summary: dict, why: str | None) -> str:
    """Why a sweep registered no model (`why`: its best trial's reason), and what to do."""
    if not summary.get("best_run_id"):
        return (f"no trial completed ({', '.join(f'{n} {k}' for k, n in summary['trials'].items()) or 'none ran'}); "
                "the failed trials' runs say why")
    return (f"best trial {summary['best_trial']} ({summary['best_value']:.6g}, run {summary['best_run_id']}) "
            f"{why or 'left no model'}")


def run_trials(kept: Kept, space: dict[str, Distribution], params: SweepParams, slots: Slots, parent_id: str,
               metric: str, folder: TrialFolder | None = None) -> dict[str, dict]:
    """Ask, run and tell until the budget is met, at most `slots.parallel` at a time, each on a slot of its own;
    stopped from outside, the trials' ranks are stopped and their trials marked cut off; {run id: result}."""
    log, study, name = get_run_logger(), kept.study, kept.study.study_name
    running: dict[Future, Trial] = {}
    outcomes: dict[str, dict] = {}  # run id -> rank 0's result, as each trial returned it
    failures, warned, last_beat = 0, False, 0.0
    pool = ThreadPoolExecutor(max_workers=slots.parallel, thread_name_prefix="gpuflow-trial")
    done = counted(study)  # read again only when it may have changed: it reads every trial's every value
    try:
        while (wanted := params.trials - done - len(running)) > 0 or running:
            if wanted > 0 and len(running) < slots.parallel:
                if (slot := slots.take()) is not None:
                    if params.trials - (done := counted(study)) - len(running) <= 0:
                        slots.give_back(slot)  # another process sharing the study met the budget meanwhile
                        continue
                    warned = False
                    t = start_trial(kept, space, slot)
                    log.info("trial %d on %s: %s", t.trial.number, slot.label, t.values)
                    running[pool.submit(copy_context().run, run_trial, t, params, parent_id, metric, name, folder)] = t
                    continue
                if not running:  # no trial to wait on: look for a slot again in a second
                    if not warned:
                        log.warning("sweep %s: every slot is held by another gpuflow run%s; waiting", name,
                                    " or its cards are busy or short of memory" if slots.gpu else "")
                    warned = True
                    time.sleep(1.0)
                    continue
            if time.monotonic() - last_beat > HEARTBEAT_S / 2:
                for t in running.values():
                    kept.beat(t.trial.number)
                last_beat = time.monotonic()
            finished, _ = wait(list(running), timeout=1.0, return_when=FIRST_COMPLETED)
            for fut in finished:
                t = running.pop(fut)
                if t.result is not None:
                    outcomes[t.run_id] = t.result
                slots.give_back(t.slot)
                failures = failures + 1 if tell(study, t, fut, log, metric) else 0
                if failures >= CONSECUTIVE_FAILURES:
                    raise SweepError(f"sweep {name}: {failures} trials failed in a row, the last: "
                                     f"{one_line(fut.exception())}") from fut.exception()
                done = counted(study)
                log.info("sweep %s: %d of %d trials done, %d running; best so far: %s", name, done,
                         params.trials, len(running), best_so_far(study))
    except BaseException:
        for t in running.values():  # stop every trial's ranks, then mark them cut off
            t.stop.set()
        wait(list(running), timeout=120)
        for t in running.values():
            t.store()
            kept.cut_off(t.trial.number, "the sweep was stopped")
            slots.give_back(t.slot)
        raise
    finally:
        pool.shutdown(wait=True)
    return outcomes


def start_trial(kept: Kept, space: dict[str, Distribution], slot: Slot) -> Trial:
    """Ask Optuna for a trial (its first heartbeat at once: a crash now leaves no zombie)."""
    trial = kept.study.ask()
    kept.beat(trial.number)
    trial.set_user_attr("owner", orphans.owner_tags())  # this process: a restart fails its trial if it is gone
    trial.set_user_attr("slot", slot.label)
    return Trial(trial, slot, {n: d.suggest(trial, n) for n, d in space.items()}, pruning=kept.pruning)


def tell(study, t: Trial, fut: Future, log, metric: str) -> bool:
    """Record the trial's end in the study (its score, pruned, or failed with the first line why); True if failed."""
    from optuna.trial import TrialState

    error = fut.exception()
    t.store()
    if error is None and t.pruned_at is not None:
        study.tell(t.trial, state=TrialState.PRUNED)
        log.info("trial %d: pruned after epoch %d (%s %.6g)", t.trial.number, t.pruned_at, metric,
                 t.reported[t.pruned_at])
        return False
    if error is None:
        t.pruning.completed_here(study.tell(t.trial, fut.result()))
        log.info("trial %d: %s", t.trial.number, fut.result())
        return False
    if isinstance(error, SweepError):
        raise error
    t.trial.set_user_attr("error", one_line(error)[:1000])
    study.tell(t.trial, state=TrialState.FAIL)
    log.warning("trial %d failed: %s", t.trial.number, one_line(error))
    return True


def register_best(params: SweepParams, client, summary: dict, name: str, metric: str, result: dict | None,
                  beside) -> dict:
    """Register the best trial's model and put it through the champion/challenger rule (flows/champion.py) by the
    `metric` it was chosen by, the `beside` block (the plots) running meanwhile; `result` as the trial returned it,
    or None: read from its folder."""
    run_id = summary["best_run_id"]
    folder = RunFolder.of(params.runs_dir, run_id)
    result = result or json.loads(folder.result.read_text())
    run = tracked.attached_run(params.tracking_uri, run_id, folder.root)
    how = f"best trial {summary['best_trial']} of sweep {name} ({summary['best_params']})"
    if params.script:  # registered as train-script registers it; gpuflow cannot evaluate it
        with beside:
            version = Script(params).register(run, result, params.registered_model, f"(run {run_id}): {how}")
        return {"model_version": version, "unregistered": unregistrable(result) if version is None else None,
                "promoted": version is not None and offer_unevaluated(client, params.registered_model, version)}
    version = results.register_model(run, result, params.registered_model, str(Path.cwd()),
                                     f"{params.model} on {params.dataset}: {how}")
    with beside:  # the evaluations run in a child process: the plots' imports and drawing take no time of theirs
        decision = compare_with_champion(params, client, version, run_id, "sweep", metric)
    return {"model_version": version, "promoted": decision["promoted"]}
