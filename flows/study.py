"""A sweep's Optuna study: where it is kept, opening it (trials a dead sweep left RUNNING failed),
what counts against the budget, and its record in the parent MLflow run (table, best, plots).

The study is kept in `storage` (default: optuna.db beside the SQLite tracking store; on the team
stack, the stack's PostgreSQL), so a sweep stopped by Ctrl-C or a crash continues when started
again with the same `study`: its finished trials are not run again and a trial cut off is marked
failed.
"""

from __future__ import annotations

import socket
import urllib.parse
import warnings
from contextlib import contextmanager
from pathlib import Path

from prefect import get_run_logger

from gpuflow.tasks.tracking import orphans, store, tracked

from .calls import one_line
from .params import SweepParams
from .space import SweepError
from .stack import STUDY_VARIABLE
from .train import dataset_label

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


def best_so_far(study) -> str:
    try:
        return f"trial {study.best_trial.number}, {study.best_value:.6g}"
    except ValueError:  # no trial has finished yet
        return "none yet"


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


