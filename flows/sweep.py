"""The sweep flow: Optuna samples and prunes; each trial is one more launcher of the training
session (the same device plan, card locks, MLflow handling and failure lines as a single run),
nested under one parent MLflow run; the best trial's model is registered and promoted only if
it beats the champion.

    gpuflow sweep --space sweep.yaml --trials 24 --parallel auto --pruner median
    prefect deployment run 'sweep/default' -p space=sweep.yaml -p trials=24

The space file names run parameters (and `model_args.<key>`) with their distributions:

    lr: {type: float, low: 1.0e-4, high: 0.1, log: true}
    batch_size: {type: int, low: 32, high: 256, step: 32}
    optimizer: {type: choice, values: [adam, sgd]}
    model_args.hidden: {type: int, low: 32, high: 512, log: true}

A user's script sweeps too: `gpuflow sweep --script train.py --space s.yaml --optimize val_loss --
--lr {lr}`. Each trial runs it as train-script does, `{name}` in its arguments replaced by the
trial's value (a name without a placeholder is appended as `--name=value`); the metric it logs
(helper.report, or its own mlflow.log_metric on rank 0) is read from the run as it arrives, and a
pruned trial's ranks are stopped by the flow: the script needs no Optuna code.

The study is kept in `storage` (default: optuna.db beside the SQLite tracking store), so a
sweep stopped by Ctrl-C or a crash continues when started again with the same `study`: its
finished trials are not run again and a trial cut off is marked failed.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.parse
import warnings
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from contextvars import copy_context
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from gpuflow.tasks.devices.cards import CardLocks, device_slot
from gpuflow.tasks.devices.probe import EnvironmentReport, probe_environment
from gpuflow.tasks.launch import Stopped
from gpuflow.tasks.tracking import orphans, results, store, tracked
from gpuflow.training.contract import RunFolder
from gpuflow.training.errors import UserError

from .calls import one_line
from .params import PipelineParams, ScriptParams, SweepParams, flat_parameters
from .space import Distribution, SweepError, read_space, with_values
from .prepared import prepared
from .retrain import compare_with_champion
from .session import run_tags, training_session
from .stack import STUDY_VARIABLE
from .train import dataset_label, train

CONSECUTIVE_FAILURES = 3  # trials failing in a row stop the sweep: the next would fail the same way
HEARTBEAT_S = 10  # a RUNNING trial whose heartbeat is older than twice this is stale (Optuna)


def study_name(params: SweepParams) -> str:
    return params.study or default_study(params.model_dump())


def default_study(p: dict) -> str:
    """sweep-<script> for a script's sweep, else sweep-<model>-<dataset>."""
    if p.get("script"):
        return f"sweep-{Path(p['script']).stem}"
    return f"sweep-{dataset_label(p.get('model', 'mlp'))}-{dataset_label(p.get('dataset', 'digits'))}"


def storage_url(params: SweepParams) -> str:
    """The study's storage: as given; else optuna.db beside a SQLite tracking store; else the team
    stack's database (which `gpuflow stack` publishes in a Prefect Variable); else optuna.db here."""
    if params.storage:
        return params.storage
    uri = store.absolute_uri(params.tracking_uri)
    if uri.startswith("sqlite:///"):
        return f"sqlite:///{Path(uri[len('sqlite:///'):]).parent / 'optuna.db'}"
    from prefect.variables import Variable

    published = Variable.get(STUDY_VARIABLE, default=None)
    if not published:
        return f"sqlite:///{Path.cwd() / 'optuna.db'}"
    socket_dir = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(published).query)).get("host", "")
    if socket_dir.startswith("/") and not Path(socket_dir).is_dir():
        raise SweepError(f"the team stack keeps studies at {shown_url(published)}, a Unix socket of the stack's "
                         "own machine; on this machine give storage=<a database URL this machine reaches>")
    return published


def shown_url(url: str) -> str:
    """A storage URL as logs and tags may show it: without its password."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def objective_target(params: SweepParams) -> tuple[str, str]:
    """(the metric the trials report and the sweep optimizes, minimize or maximize)."""
    if params.script:  # the script's own metric (required); its direction by name unless given
        guess = "minimize" if "loss" in params.optimize else "maximize"
        return params.optimize, guess if params.direction == "auto" else params.direction
    monitor, mode = {"classification": ("accuracy", "max"), "model-loss": ("loss", "min")}.get(
        params.objective, (None, None))
    if monitor is None:  # the user's own objective: its monitor and mode (user code, as in preflight)
        from gpuflow.training.objective import load_objective

        obj = load_objective(params.objective, str(Path.cwd()))
        monitor, mode = obj.monitor, obj.mode
    metric = params.optimize if params.optimize != "auto" else f"val_{monitor}"
    if params.direction != "auto":
        return metric, params.direction
    if params.optimize != "auto" and metric != f"val_{monitor}":
        mode = "min" if "loss" in metric else "max"
    return metric, "minimize" if mode == "min" else "maximize"


# --- where trials run --------------------------------------------------------------------


@dataclass
class Slot:
    """The devices of one trial: explicit cards ('3,1,'), or one CPU slot held by its lock."""

    label: str
    gpus: str
    processes: int = 0  # on the CPU: the trial's DDP processes
    cards: tuple[int, ...] = ()
    lock: CardLocks | None = None


class Slots:
    """Trials' devices: groups of `gpus_per_trial` cards that no other gpuflow run holds (the card
    locks decide, as for any run), or on a host without a GPU, CPU slots (lock files in the same
    folder: `<host>-cpu<k>.lock`). A card or slot held elsewhere is never given: the sweep waits."""

    def __init__(self, params: SweepParams, report: EnvironmentReport):
        self.params, self.report = params, report
        visible = report.visible_physical_ids()
        self.gpu = bool(visible) and params.gpus != "cpu"
        self.per_trial = params.gpus_per_trial if self.gpu else (params.cpu_processes or 1)
        if self.gpu:
            named = [int(p) for p in params.gpus.split(",") if p] if "," in params.gpus else None
            self.pool = named or visible
            capacity = len(self.pool) // self.per_trial
            what = f"{len(self.pool)} GPUs ({params.gpus_per_trial} per trial)"
        else:
            self.pool = list(range((os.cpu_count() or 1) // self.per_trial))
            capacity = len(self.pool)
            what = f"{os.cpu_count()} CPUs ({self.per_trial} process(es) per trial)"
        if capacity < 1:
            raise SweepError(f"gpus_per_trial={self.per_trial} is more than the {what}; ask for fewer per trial")
        want = capacity if params.parallel == "auto" else int(params.parallel)
        if want > capacity:
            raise SweepError(f"parallel={params.parallel} trials do not fit on {what}: at most {capacity} "
                             "run at a time; lower parallel or gpus_per_trial")
        self.parallel = want
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
            lock = CardLocks(ranks_wait_s=0)
            if lock.try_lock(f"{socket.gethostname()}-cpu{k}"):
                self.busy.add(k)
                return Slot(f"cpu{k}", "cpu", self.per_trial, (k,), lock)
        return None

    def _take_gpus(self) -> Slot | None:
        held = CardLocks(ranks_wait_s=0).held_elsewhere(self.report)
        free = [i for i in self.pool if i not in self.busy and i not in held]
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


# --- the study ---------------------------------------------------------------------------


def open_study(params: SweepParams, direction: str, url: str):
    """The study, created or loaded in `url`; trials left RUNNING by a sweep that is gone are failed
    (this host's by their owner's pid, others' by their stale heartbeat)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # heartbeats are what makes a crashed sweep's trials fail (not leave zombies): used on purpose
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    storage = optuna.storages.RDBStorage(url, engine_kwargs=kwargs, heartbeat_interval=HEARTBEAT_S)
    sampler = optuna.samplers.TPESampler(seed=params.sampler_seed, constant_liar=True,
                                         n_startup_trials=min(10, max(2, params.trials // 3)))
    pruner = (optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0) if params.pruner == "median"
              else optuna.pruners.NopPruner())
    study = optuna.create_study(storage=storage, study_name=study_name(params), direction=direction,
                                sampler=sampler, pruner=pruner, load_if_exists=True)
    if study.direction.name.lower() != direction:
        raise SweepError(f"study {study_name(params)!r} in {shown_url(url)} was created to {study.direction.name.lower()}, "
                         f"not {direction}; name a new study")
    cut_off_orphans(study)
    optuna.storages.fail_stale_trials(study)
    return study


def cut_off_orphans(study) -> None:
    from optuna.trial import TrialState

    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = t.user_attrs.get("owner") or {}
        if owner.get(orphans.OWNER_HOST) == socket.gethostname() and not orphans.owner_alive(owner):
            study._storage.set_trial_user_attr(t._trial_id, "cut_off", "its sweep process is gone")
            study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)


def counted(study) -> int:
    """Trials that count against the budget: finished, pruned, or failed on their own (not cut off)."""
    from optuna.trial import TrialState

    return sum(1 for t in study.get_trials(deepcopy=False)
               if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
               or (t.state == TrialState.FAIL and "cut_off" not in t.user_attrs))


# --- one trial ---------------------------------------------------------------------------


@dataclass
class Trial:
    """A trial on its way: the Optuna trial, its slot, the values and how it is stopped."""

    trial: Any
    slot: Slot
    values: dict
    stop: threading.Event = field(default_factory=threading.Event)
    pruned_at: int | None = None
    missing: list[str] | None = None
    run_id: str | None = None


def trial_tags(t: Trial, parent_id: str, study_name: str) -> dict:
    return {"mlflow.parentRunId": parent_id, "sweep.study": study_name, "sweep.trial": t.trial.number,
            "sweep.slot": t.slot.label}


def reporter(t: Trial, params: SweepParams, metric: str):
    """The trial's per-epoch report to Optuna: pruned (its launch stopped) when the pruner says so."""

    def report(step: int, metrics: dict) -> None:
        if metric not in metrics:
            t.missing = sorted(k for k in metrics if k.startswith("val_"))
            t.stop.set()
            return
        t.trial.report(metrics[metric], step)
        if params.pruner != "none" and t.trial.should_prune():
            t.pruned_at = step
            t.stop.set()

    return report


def run_trial(t: Trial, params: SweepParams, parent_id: str, metric: str, study_name: str) -> float:
    """One trial as one run of the training session, nested under the sweep's run; its per-epoch
    metric reported to the pruner as the relay logs it. Returns the metric's final value, or None
    when pruned (its run FINISHED, tagged sweep.pruned); a trial stopped with its sweep is KILLED."""
    if params.script:
        return run_script_trial(t, params, parent_id, metric, study_name)
    number = t.trial.number
    trial_params = PipelineParams.model_validate(with_values(params.pipeline(), t.values) | {
        "gpus": t.slot.gpus, "cpu_processes": t.slot.processes,
        "run_name": f"{study_name}-t{number}"})
    report = reporter(t, params, metric)
    tags = trial_tags(t, parent_id, study_name) | {"dataset": trial_params.dataset, "model": trial_params.model}
    with training_session(trial_params, trial_params.batch_size, trial_params.precision, slot=False) as s:
        data = prepared(trial_params, s)
        with s.run("trial", tags, trial_params.world_size(s.plan), data.model_dump(mode="json"),
                   name=trial_params.run_name) as run:
            t.run_id = run.run_id
            t.trial.set_user_attr("mlflow_run_id", run.run_id)
            result = train(trial_params, s, data, RunFolder(run.workdir), run, report, t.stop)
            if result.get("stopped"):
                if t.missing is not None:
                    raise SweepError(f"optimize={metric!r}: the trial's epochs report no such metric (they "
                                     f"report {', '.join(t.missing)}); use one of those")
                if t.pruned_at is None:
                    raise Stopped()  # the sweep is being stopped
                run.client.set_tag(run.run_id, "sweep.pruned", f"after epoch {t.pruned_at}")
                return None
            results.log_results(run, result, None, str(Path.cwd()), "")
    value = result["final_metrics"].get(metric)
    if value is None:
        raise SweepError(f"optimize={metric!r}: the trial's final metrics have no such value")
    return float(value)


def run_script_trial(t: Trial, params: SweepParams, parent_id: str, metric: str, study_name: str) -> float:
    """A script's trial: the script run as train-script runs it, with the trial's values in its
    arguments; the metric it logs (helper.report or its own mlflow.log_metric) read from the run
    as it arrives, for the pruner, which stops its ranks itself. Its outputs (checkpoint, declared
    model) are kept in the run folder's result file, for registering the best."""
    from .script import run_script

    trial_params = ScriptParams.model_validate(params.script_params(t.values) | {
        "gpus": t.slot.gpus, "cpu_processes": t.slot.processes, "run_name": f"{study_name}-t{t.trial.number}"})
    tags = trial_tags(t, parent_id, study_name) | {"script": trial_params.script}
    with training_session(trial_params, slot=False) as s, \
            s.run(Path(trial_params.script).stem, tags, s.plan.nproc_per_node, name=trial_params.run_name) as run:
        t.run_id = run.run_id
        t.trial.set_user_attr("mlflow_run_id", run.run_id)
        run.log_params(trial_params.run_params(s.plan))
        try:
            with watching(run, metric, reporter(t, params, metric)):
                outputs = run_script(trial_params, s, run, stop=t.stop)
        except Stopped:
            if t.pruned_at is None:
                raise
            run.client.set_tag(run.run_id, "sweep.pruned", f"after epoch {t.pruned_at}")
            return None
        RunFolder(run.workdir).result.write_text(json.dumps(outputs))
        logged = run.client.get_run(run.run_id).data.metrics
    if metric not in logged:
        raise SweepError(f"optimize={metric!r}: the script logged no such metric (it logged "
                         f"{', '.join(sorted(logged)) or 'none'}); report it with helper.report or "
                         "mlflow.log_metric, or optimize one of those")
    return float(logged[metric])


@contextmanager
def watching(run: tracked.TrackedRun, metric: str, report, interval: float = 1.0):
    """Read `metric`'s values from the run while the block runs (whoever logs them: the relay or
    the script itself) and give each new one to `report`; the k-th value is epoch k."""
    done = threading.Event()

    def poll() -> None:
        seen = 0
        while not done.wait(interval):
            history = sorted(run.client.get_metric_history(run.run_id, metric), key=lambda m: (m.step, m.timestamp))
            for k, m in enumerate(history[seen:], start=seen):
                report(k, {metric: m.value})
            seen = len(history)

    watcher = threading.Thread(target=poll, name="gpuflow-trial-metric", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


# --- the sweep ---------------------------------------------------------------------------


def sweep_run_name() -> str:
    p = flow_run.get_parameters()
    return p.get("study") or default_study(p)


@flow(name="sweep", flow_run_name=sweep_run_name, validate_parameters=False,
      on_crashed=[orphans.end_flow_run_mlflow_runs], on_cancellation=[orphans.end_flow_run_mlflow_runs])
@flat_parameters(SweepParams)
def sweep(params: SweepParams) -> dict:
    """Search a run's parameters with Optuna: trials in parallel on separate cards, pruned early,
    nested under one MLflow run; the best trial registered and promoted if it beats the champion."""
    log = get_run_logger()
    space = read_space(params.space)  # checked already, with the other parameters (SweepParams)
    metric, direction = objective_target(params)
    slots = Slots(params, probe_environment())
    url = storage_url(params)
    study = open_study(params, direction, url)
    name = study_name(params)
    done = counted(study)
    log.info("sweep %s: %d of %d trials done; %d at a time on %s; optimizing %s (%s); study in %s", name, done,
             params.trials, slots.parallel, "GPUs" if slots.gpu else "CPU slots", metric, direction,
             shown_url(url))
    resume = study.user_attrs.get("mlflow_run_id")
    client = store.prepare_store(params.tracking_uri)
    if resume and not run_exists(client, resume):
        resume = None
    with tracked.tracked_run(params.tracking_uri, params.experiment, name,
                             {**run_tags(), "sweep.study": name, "sweep.storage": shown_url(url)}, None,
                             params.runs_dir, resume=resume) as parent:
        study.set_user_attr("mlflow_run_id", parent.run_id)
        parent.log_json({k: v.model_dump(exclude_none=True) for k, v in space.items()}, "space.json", "sweep")
        if not resume:
            parent.log_params({"sweep.trials": params.trials, "sweep.parallel": slots.parallel,
                               "sweep.pruner": params.pruner, "sweep.optimize": metric,
                               "sweep.direction": direction, "sweep.space": sorted(space)})
        with device_slot():  # one served run on this host's devices (its trials do not queue on it again)
            run_trials(study, space, params, slots, parent.run_id, metric, name)
        summary = summarize(study, parent, metric)
        if summary.get("best_run_id"):
            summary |= register_best(params, client, summary, name)
            for k in ("model_version", "promoted"):
                parent.client.set_tag(parent.run_id, f"sweep.{k}", str(summary.get(k)))
    log.info("sweep %s: %s", name, {k: v for k, v in summary.items() if k != "trials_table"})
    return {"run_id": parent.run_id, "study": name, **summary}


def run_exists(client, run_id: str) -> bool:
    try:
        client.get_run(run_id)
        return True
    except Exception:  # noqa: BLE001 - deleted, or another store: a new parent run
        return False


def run_trials(study, space: dict[str, Distribution], params: SweepParams, slots: Slots, parent_id: str,
               metric: str, name: str) -> None:
    """Ask, run and tell until the budget is met: at most `slots.parallel` at a time, each on a
    slot of its own, with heartbeats for those running. Stopped from outside (Ctrl-C, SIGTERM,
    cancel), the trials' ranks are stopped and their trials marked failed (cut off)."""
    from optuna.trial import TrialState

    log = get_run_logger()
    running: dict[Future, Trial] = {}
    failures, waiting_since, last_beat = 0, None, 0.0
    pool = ThreadPoolExecutor(max_workers=slots.parallel, thread_name_prefix="gpuflow-trial")
    try:
        while counted(study) + len(running) < params.trials or running:
            if counted(study) + len(running) < params.trials and len(running) < slots.parallel:
                slot = slots.take()
                if slot is None:
                    if not running and waiting_since is None:
                        waiting_since = time.monotonic()
                        log.warning("sweep %s: every slot is held by another gpuflow run; waiting", name)
                else:
                    waiting_since = None
                    t = start_trial(study, space, slot)
                    log.info("trial %d on %s: %s", t.trial.number, slot.label, t.values)
                    running[pool.submit(copy_context().run, run_trial, t, params, parent_id, metric, name)] = t
                    continue
            if time.monotonic() - last_beat > HEARTBEAT_S / 2:
                for t in running.values():
                    study._storage.record_heartbeat(t.trial._trial_id)
                last_beat = time.monotonic()
            finished, _ = wait(list(running), timeout=1.0, return_when=FIRST_COMPLETED)
            for fut in finished:
                t = running.pop(fut)
                slots.give_back(t.slot)
                failures = 0 if tell(study, t, fut, log) != TrialState.FAIL else failures + 1
                if failures >= CONSECUTIVE_FAILURES:
                    raise SweepError(f"sweep {name}: {failures} trials failed in a row, the last: "
                                     f"{one_line(fut.exception())}") from fut.exception()
                log.info("sweep %s: %d of %d trials done, %d running; best so far: %s", name, counted(study),
                         params.trials, len(running), best_so_far(study))
    except BaseException:
        for t in running.values():  # stop every trial's ranks, then mark them cut off
            t.stop.set()
        wait(list(running), timeout=120)
        for t in running.values():
            study._storage.set_trial_user_attr(t.trial._trial_id, "cut_off", "the sweep was stopped")
            if study._storage.get_trial(t.trial._trial_id).state == TrialState.RUNNING:
                study._storage.set_trial_state_values(t.trial._trial_id, TrialState.FAIL)
            slots.give_back(t.slot)
        raise
    finally:
        pool.shutdown(wait=True)


def best_so_far(study) -> str:
    try:
        return f"trial {study.best_trial.number}, {study.best_value:.6g}"
    except ValueError:  # no trial has finished yet
        return "none yet"


def start_trial(study, space: dict[str, Distribution], slot: Slot) -> Trial:
    """Ask Optuna for a trial (its first heartbeat at once: a crash now leaves no zombie)."""
    trial = study.ask()
    study._storage.record_heartbeat(trial._trial_id)
    trial.set_user_attr("owner", orphans.owner_tags())  # this process: a restart fails its trial if it is gone
    trial.set_user_attr("slot", slot.label)
    return Trial(trial, slot, {n: d.suggest(trial, n) for n, d in space.items()})


def tell(study, t: Trial, fut: Future, log):
    """Record the trial's end in the study: its score, pruned, or failed (with the first line why)."""
    from optuna.trial import TrialState

    error = fut.exception()
    if error is None and t.pruned_at is not None:
        study.tell(t.trial, state=TrialState.PRUNED)
        log.info("trial %d: pruned after epoch %d", t.trial.number, t.pruned_at)
        return TrialState.PRUNED
    if error is None:
        study.tell(t.trial, fut.result())
        log.info("trial %d: %s", t.trial.number, fut.result())
        return TrialState.COMPLETE
    if isinstance(error, SweepError):
        raise error
    t.trial.set_user_attr("error", one_line(error)[:1000])
    study.tell(t.trial, state=TrialState.FAIL)
    log.warning("trial %d failed: %s", t.trial.number, one_line(error))
    return TrialState.FAIL


def summarize(study, parent: tracked.TrackedRun, metric: str) -> dict:
    """The parent run's table of trials, best params and score, and the plots a user looks at."""
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    table = study.trials_dataframe(attrs=("number", "value", "params", "state", "duration", "user_attrs"))
    with tempfile_path("trials.csv") as p:
        table.to_csv(p, index=False)
        parent.client.log_artifact(parent.run_id, str(p), "sweep")
    states = {s.name.lower(): n for s in TrialState if (n := sum(1 for t in study.trials if t.state == s))}
    parent.log_metrics({f"sweep.trials_{k}": v for k, v in states.items()})
    if not complete:
        return {"best_run_id": None, "trials": states}
    best = study.best_trial
    parent.log_metrics({f"best_{metric}": best.value})
    parent.log_params({f"best.{k}": v for k, v in best.params.items()} | {"best.trial": best.number})
    plots(study, parent)
    return {"best_trial": best.number, "best_value": best.value, "best_params": best.params,
            "best_run_id": best.user_attrs.get("mlflow_run_id"), "trials": states}


@contextmanager
def tempfile_path(name: str):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        yield Path(d) / name


def plots(study, parent: tracked.TrackedRun) -> None:
    """Optimisation history, parameter importances and parallel coordinates, as images."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as vis

    for name, draw in (("optimization_history", vis.plot_optimization_history),
                       ("param_importances", vis.plot_param_importances),
                       ("parallel_coordinate", vis.plot_parallel_coordinate)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ax = draw(study)
            fig = (ax.flat[0] if hasattr(ax, "flat") else ax).figure
            fig.set_size_inches(9, 5)
            parent.client.log_figure(parent.run_id, fig, f"sweep/{name}.png")
            plt.close(fig)
        except Exception as e:  # noqa: BLE001 - too few trials for importances, say: the rest still log
            get_run_logger().info("sweep plot %s not drawn: %s", name, one_line(e))


def register_best(params: SweepParams, client, summary: dict, name: str) -> dict:
    """Register the best trial's model and put it through the champion/challenger comparison."""
    run_id = summary["best_run_id"]
    folder = RunFolder(Path(params.runs_dir).resolve() / run_id)
    result = json.loads(folder.result.read_text())
    run = tracked.attached_run(params.tracking_uri, run_id, folder.root)
    if params.script:
        return register_best_script(params, client, run, result, summary, name)
    version = results.register_model(run, result, params.registered_model, str(Path.cwd()),
                                     f"{params.model} on {params.dataset}: best trial {summary['best_trial']} of "
                                     f"sweep {name} ({summary['best_params']})")
    decision = compare_with_champion(params, client, version, run_id, "sweep")
    return {"model_version": version, "promoted": decision["promoted"]}


def register_best_script(params: SweepParams, client, run: tracked.TrackedRun, outputs: dict, summary: dict,
                         name: str) -> dict:
    """A script's best model (when it declared one), registered; promoted only while there is no
    champion: gpuflow cannot evaluate a script's model on the champion's data, so it never replaces
    one without that comparison (the version's outcome tag says so)."""
    log = get_run_logger()
    if not outputs.get("model_spec") or not outputs.get("weights"):
        log.info("sweep %s: no model registered: the best trial's script declared no model "
                 "(gpuflow.training.helper.declare_model) or saved no state dict", name)
        return {"model_version": None, "promoted": False}
    from gpuflow.tasks.tracking.registry import champion_version, promote

    version = results.register_model(run, {"model_spec": outputs["model_spec"], "weights": outputs["weights"]},
                                     params.registered_model, str(Path.cwd()),
                                     f"{outputs['model_spec']['reference']} trained by {Path(params.script).name}: "
                                     f"best trial {summary['best_trial']} of sweep {name} ({summary['best_params']})")
    champion = champion_version(client, params.registered_model)
    promoted = champion is None
    if promoted:
        promote(client, params.registered_model, version)
    client.set_model_version_tag(params.registered_model, version, results.OUTCOME_TAG,
                                 "promoted: no champion before" if promoted else
                                 f"not compared: champion v{champion} kept (a script's model has no gpuflow "
                                 "evaluation; compare them and move the alias yourself)")
    return {"model_version": version, "promoted": promoted}
