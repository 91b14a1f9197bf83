"""A sweep's Optuna study: where it is kept (so a stopped sweep continues when started again with the same
`study`), opening it, what counts against the budget, and its record in the parent MLflow run.
"""

from __future__ import annotations

import math
import re
import socket
import threading
import time
import urllib.parse
import warnings
from collections import Counter
from contextlib import contextmanager
from contextvars import copy_context
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import get_run_logger

from gpuflow.tasks.tracking import orphans, tracked
from gpuflow.training.uris import shown, sqlite_file as sqlite_path

from .calls import one_line
from .params import SweepParams
from .space import SweepError
from .stack import STUDY_VARIABLE
from .launchers import stem

RUN_ID = re.compile(r"[0-9a-f]{32}")  # an MLflow run id: never a path, a filter or a query
HEARTBEAT_S = 10  # a RUNNING trial whose heartbeat is older than twice this is stale (Optuna)
PRUNE_REFRESH_S = 30.0  # how old the pruner's copy of trials completed by another process may be


def study_name(values: dict) -> str:
    """The sweep's (and its flow run's) study: as given, else sweep-<the stem of its runs' names>."""
    return values.get("study") or f"sweep-{stem(values)}"


def storage_url(params: SweepParams) -> str:
    """The study's storage: as given; else optuna.db beside a SQLite tracking store; else the team stack's
    database (a Prefect Variable); else optuna.db here."""
    if params.storage:
        return params.storage
    if db := sqlite_path(params.tracking_uri):
        return f"sqlite:///{db.parent / 'optuna.db'}"
    from prefect.variables import Variable

    published = Variable.get(STUDY_VARIABLE, default=None)
    if not published:
        return f"sqlite:///{Path.cwd() / 'optuna.db'}"
    socket_dir = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(published).query)).get("host", "")
    if socket_dir.startswith("/") and not Path(socket_dir).is_dir():
        raise SweepError(f"the team stack keeps studies at {shown(published)}, a Unix socket of the stack's "
                         "own machine; on this machine give storage=<a database URL this machine reaches>")
    return published


def open_study(params: SweepParams, metric: str, direction: str, url: str):
    """The study, created or loaded in `url` (a loaded one optimizing the same `metric` in the same direction);
    trials left RUNNING by a sweep that is gone are failed (this host's by their owner's pid, others' by their
    stale heartbeat)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # heartbeats are what makes a crashed sweep's trials fail (not leave zombies): used on purpose
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    storage = optuna.storages.RDBStorage(url, engine_kwargs=kwargs, heartbeat_interval=HEARTBEAT_S,
                                         heartbeat_stale_trial_callback=_stale)
    sampler = optuna.samplers.TPESampler(seed=params.sampler_seed, constant_liar=True,
                                         n_startup_trials=min(10, max(2, params.trials // 3)))
    pruner = (optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0) if params.pruner == "median"
              else optuna.pruners.NopPruner())
    study = optuna.create_study(storage=storage, study_name=study_name(params.model_dump()),
                                direction=direction, sampler=sampler, pruner=pruner, load_if_exists=True)
    if study.direction.name.lower() != direction:
        raise SweepError(f"study {study.study_name!r} in {shown(url)} was created to {study.direction.name.lower()}, "
                         f"not {direction}; name a new study")
    optimizes = study.user_attrs.get("optimize")  # one read: each is a query of the storage
    if optimizes is None:
        study.set_user_attr("optimize", metric)
    elif optimizes != metric:  # its trials' values are of another metric
        raise SweepError(f"study {study.study_name!r} in {shown(url)} optimizes {optimizes}, not {metric}; sweep "
                         f"with --optimize {optimizes}, or name a new study")
    kept = Kept(study, storage, storage.get_study_id_from_name(study.study_name))
    cut_off_orphans(kept)
    optuna.storages.fail_stale_trials(study)
    return kept


class Pruning:
    """The study's pruner asked about a running trial's values as this process reported them, against a copy of the
    study's COMPLETE trials (`Trial.should_prune()` reads the running trial back from the database on every call).
    A trial this sweep completes joins the copy at once; the copy is read again every PRUNE_REFRESH_S, for trials
    another process sharing the study completed. The rule and its inputs are Optuna's."""

    def __init__(self, study):
        self.study, self._lock, self._read_at, self._completed = study, threading.Lock(), -math.inf, None
        self._numbers: set[int] = set()

    def completed(self):
        import optuna
        from optuna.trial import TrialState

        with self._lock:
            if time.monotonic() - self._read_at >= PRUNE_REFRESH_S:
                trials = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                self._completed = optuna.create_study(directions=self.study.directions)
                self._completed.add_trials(trials)
                self._numbers, self._read_at = {t.number for t in trials}, time.monotonic()
            return self._completed

    def completed_here(self, trial) -> None:
        """A trial this process completed (`study.tell`'s FrozenTrial), in the copy without reading the study."""
        with self._lock:
            if self._completed is not None and trial.number not in self._numbers:
                self._completed.add_trial(trial)
                self._numbers.add(trial.number)

    def says(self, number: int, values: dict[int, float]) -> bool:
        """Prune trial `number`, whose reported values are `values` (step: value)?"""
        from optuna.trial import FrozenTrial, TrialState

        running = FrozenTrial(number=number, state=TrialState.RUNNING, value=None, datetime_start=None,
                              datetime_complete=None, params={}, distributions={}, user_attrs={}, system_attrs={},
                              intermediate_values=dict(values), trial_id=-1)
        return self.study.pruner.prune(self.completed(), running)


@dataclass
class Kept:
    """A study and the storage it was opened on, so trials are reached by Optuna's public API."""

    study: Any
    storage: Any
    study_id: int

    def __post_init__(self):
        self.pruning = Pruning(self.study)

    def trial_id(self, number: int) -> int:
        return self.storage.get_trial_id_from_study_id_trial_number(self.study_id, number)

    def beat(self, number: int) -> None:
        self.storage.record_heartbeat(self.trial_id(number))

    def cut_off(self, number: int, why: str) -> None:
        """Marked cut off (it does not count against the budget) and, still RUNNING, failed."""
        from optuna.trial import TrialState

        tid = self.trial_id(number)
        self.storage.set_trial_user_attr(tid, "cut_off", why)
        if self.storage.get_trial(tid).state == TrialState.RUNNING:
            self.storage.set_trial_state_values(tid, TrialState.FAIL)


def cut_off_orphans(kept: Kept) -> None:
    from optuna.trial import TrialState

    for t in kept.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = t.user_attrs.get("owner") or {}
        if owner.get(orphans.OWNER_HOST) == socket.gethostname() and not orphans.owner_alive(owner):
            kept.cut_off(t.number, "its sweep process is gone")


def _stale(study, trial) -> None:
    """Optuna failed `trial` for its stopped heartbeat (a sweep gone, on any host): cut off, noted on the study (a
    finished trial takes no attribute)."""
    study.set_user_attr(f"cut_off.{trial.number}", "its sweep stopped beating")


def counted(study) -> int:
    """Trials that count against the budget: finished, pruned, or failed on their own (not cut off)."""
    from optuna.trial import TrialState

    marked = study.user_attrs  # trials Optuna failed as stale (_stale)
    return sum(1 for t in study.get_trials(deepcopy=False)
               if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
               or (t.state == TrialState.FAIL and "cut_off" not in t.user_attrs
                   and f"cut_off.{t.number}" not in marked))


def best_so_far(study) -> str:
    try:
        return f"trial {study.best_trial.number}, {study.best_value:.6g}"
    except ValueError:  # no trial has finished yet
        return "none yet"


def summarize(study, parent: tracked.TrackedRun, metric: str) -> dict:
    """The parent run's table of trials, best params and score."""
    table = study.trials_dataframe(attrs=("number", "value", "params", "state", "duration", "user_attrs"))
    parent.client.log_text(parent.run_id, table.to_csv(index=False), "sweep/trials.csv")
    states = dict(Counter(t.state.name.lower() for t in study.get_trials(deepcopy=False)))
    parent.log_metrics({f"sweep.trials_{k}": v for k, v in states.items()})
    if "complete" not in states:
        return {"best_run_id": None, "trials": states}
    best = study.best_trial
    run_id = best.user_attrs.get("mlflow_run_id")
    if not sweep_run(parent.client, run_id, study.study_name, best.number):
        raise SweepError(f"sweep {study.study_name}: its best trial {best.number} names MLflow run "
                         f"{str(run_id)[:64]!r}, which is not that trial's run in this tracking store; nothing "
                         "registered. Sweep with the tracking store the study was made with, or start a new study")
    parent.log_metrics({f"best_{metric}": best.value})
    parent.log_params({f"best.{k}": v for k, v in best.params.items()} | {"best.trial": best.number})
    return {"best_trial": best.number, "best_value": best.value, "best_params": best.params,
            "best_run_id": run_id, "trials": states}


def sweep_run(client, run_id, study: str, trial: int | None = None) -> bool:
    """Whether a run id read back from the study is this sweep's run (or its trial `trial`'s) in this store: an
    MLflow run id tagged with the study's name (and the trial's number). Anyone who can write the study can write
    its attributes; a deleted run, another store's, another study's, a trial's named as the parent, or a value that
    is no run id is never used."""
    if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
        return False
    try:
        run = client.get_run(run_id)
    except Exception:  # noqa: BLE001 - no such run in this store
        return False
    tags = run.data.tags
    return (run.info.lifecycle_stage == "active" and tags.get("sweep.study") == study
            and tags.get("sweep.trial") == (None if trial is None else str(trial)))


@contextmanager
def plots_beside(study, parent: tracked.TrackedRun):
    """The plots drawn on a thread while the block runs."""
    drawing = threading.Thread(target=copy_context().run, args=(plots, study, parent), name="gpuflow-sweep-plots")
    drawing.start()
    try:
        yield
    finally:
        drawing.join()


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
