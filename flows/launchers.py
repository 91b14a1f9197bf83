"""What trains, for flows/job.py: gpuflow's own worker, or a user's torchrun script. A launcher has `params`,
`stem`, `tags`, `node_flow`, `prepare(s)`, `launch(...)` returning an Outcome, and `finish(...)` returning the version.
"""

from __future__ import annotations

import json
import re
import threading
import time
from contextlib import contextmanager, nullcontext
from contextvars import copy_context
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, MAX_PARAM_VAL_LENGTH
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from gpuflow.tasks.child import Stopped
from gpuflow.tasks.launch import Rendezvous, TrainingFailed, launch_script, launch_training
from gpuflow.tasks.tracking import results, tracked
from gpuflow.training.contract import RunFolder

from .calls import one_line
from .params import PipelineParams, ScriptParams
from .prepared import prepared, retry_unless_it_repeats, worker_config
from .session import Session, unique_name
from .settings import Settings


def dataset_label(dataset: str) -> str:
    """imagefolder:/data/pets -> pets; myproj.data:datasets -> datasets; built-in names as they are."""
    if dataset.startswith("imagefolder:"):
        return Path(dataset.split(":", 1)[1]).name
    return dataset.rpartition(":")[2]


def stem(values: dict) -> str:
    """The stem of a run's (and flow run's, and default study's) name: <script>, else <model>-<dataset>."""
    if values.get("script"):
        return Path(values["script"]).stem
    return f"{dataset_label(values.get('model', 'mlp'))}-{dataset_label(values.get('dataset', 'digits'))}"


def flow_run_name() -> str:
    """A training flow run's (and MLflow run's) name: the user's run_name, else <stem>-<the flow run id's start>."""
    p = flow_run.get_parameters()
    return p.get("run_name") or unique_name(stem(p))


@dataclass
class Outcome:
    """What a launch gave back: rank 0's result; `rank0` False on a node without global rank 0; `stopped` when
    its stop was set."""

    result: dict = field(default_factory=dict)
    rank0: bool = True
    stopped: bool = False


@dataclass
class Launch:
    """Where one launch runs, from the placement: a rendezvous (a node of a placed run; its name),
    a stop event and a per-epoch listener (a sweep's trial), a working folder (a script's trial)."""

    log_params: bool = True
    rdzv: Rendezvous | None = None
    node: str | None = None
    on_metrics: Callable[[int, dict], None] | None = None  # (epoch, metrics): a sweep's pruner
    metric: str | None = None  # the metric it wants: a script may log it itself, so it is read from the run
    stop: threading.Event | None = None
    cwd: Path | None = None
    upload_checkpoints: bool = False  # each epoch's, to the run, before its metrics: a replacement resumes from it
    checkpoint_each_epoch: bool = True  # False: the last epoch's alone (a sweep's trial never resumes)


class Worker:
    """gpuflow's own worker (training/): the data step and preflight, its config, torchrun or python."""

    node_flow = "train-node"
    resumes_itself = False  # a replacement round resumes from the run's last checkpoint (nodes.last_checkpoint)

    def __init__(self, params: PipelineParams):
        self.params, self.data = params, None
        self.stem = stem({"model": params.model, "dataset": params.dataset})
        self.tags = {"dataset": params.dataset, "model": params.model}

    def prepare(self, s: Session) -> dict:
        self.data = prepared(self.params, s)
        return self.data.model_dump(mode="json")

    def launch(self, s: Session, run: tracked.TrackedRun | None, folder: RunFolder, how: Launch) -> Outcome:
        p = self.params
        config = worker_config(p, s.plan, self.data, folder, how.checkpoint_each_epoch)
        if run is not None and how.log_params:
            run.log_params(p.run_params(config, s.plan))
        # a node of a placed run is not retried alone: the parent handles a failed node (flows/nodes.py place)
        launch = launch_training.with_options(retries=p.launch_retries if how.rdzv is None else 0,
                                              retry_condition_fn=retry_unless_it_repeats)
        uploads = folder.checkpoints if how.upload_checkpoints else None
        with s.timer("launch"), run.relaying_metrics(how.on_metrics, uploads) if run else nullcontext():
            result = launch(config.to_json(folder.config), s.plan, p, folder.root,
                            run.metrics_file if run else None, s.cards, how.rdzv, how.stop)
        return Outcome(result, rank0=result.get("rank0", True), stopped=result.get("stopped", False))

    def finish(self, s: Session, run: tracked.TrackedRun, outcome: Outcome, registered: str | None,
               summary: bool) -> str | None:
        result = outcome.result
        with s.timer("log_results"):
            version = results.log_results(run, result, registered, str(Path.cwd()), self.describe(s, result))
        if summary:
            self.summarize(s, result, run, version)
            # grouped apart in the MLflow UI, so loss and accuracy lead the run's charts
            run.log_metrics({f"pipeline/{k}_s": v for k, v in s.timer.seconds.items()})
        return version

    def describe(self, s: Session, result: dict) -> str:
        """The registered version's description: what it is, how it was trained, how well it does."""
        p, m = self.params, result["final_metrics"]
        scores = ", ".join(f"{k} {v:.4f}" for k, v in m.items() if k.startswith("val_") or k == "train_loss")
        where = f" over {p.nodes} nodes" if p.nodes > 1 else ""
        return (f"{p.model} trained on {p.dataset} by run {s.name}{where}: {result['epochs_run']} epochs, "
                f"{s.plan.strategy} on {s.plan.describe()}, batch {p.batch_size}, lr {p.lr}, {p.precision}. "
                f"Final {scores}. Input and output: float32 arrays as in the signature ({p.objective}).")

    def summarize(self, s: Session, result: dict, run: tracked.TrackedRun, version: str | None) -> None:
        p, plan = self.params, s.plan
        rows = "\n".join(f"| {k} | {v:.4f} |" for k, v in result["final_metrics"].items())
        create_markdown_artifact(key="training-summary", description=f"{p.model} on {p.dataset}", markdown=(
            f"# {p.model} on {p.dataset}\n\n**Devices**: {plan.describe()} ({plan.strategy}, {plan.backend}, "
            f"world size {result['world_size']})  \n**Epochs run**: {result['epochs_run']}  \n"
            f"**MLflow run**: `{run.run_id}` (`gpuflow ui`, then {Settings().mlflow_ui_url}/#/experiments/"
            f"{run.experiment_id}/runs/{run.run_id}?workflowType=machine_learning)  \n"  # not MLflow's GenAI mode
            f"**Registered model**: {p.registered_model} v{version}\n\n"
            f"| metric | value |\n|---|---|\n{rows}\n"))


class Script:
    """A user's script, unchanged, under torchrun (tasks/launch.py launch_script); its files collected."""

    node_flow = "script-node"
    resumes_itself = True  # from its own checkpoint, as under torchrun's restarts: gpuflow cannot tell where it is

    def __init__(self, params: ScriptParams):
        self.params = params
        self.stem = stem({"script": params.script})
        self.tags = {"script": params.script}

    def prepare(self, s: Session) -> None:
        return None  # a script reads its own data

    def launch(self, s: Session, run: tracked.TrackedRun, folder: RunFolder, how: Launch) -> Outcome:
        p = self.params
        if how.log_params:
            run.log_params(p.run_params(s.plan) | argument_params(p.script_args))
        launched = time.time()  # collected files older than this were not written by the script
        rank0 = False
        try:
            with watching(run, how.metric, how.on_metrics), run.relaying_metrics():
                if launch_script(p, s.plan, run, s.cards, how.rdzv, how.stop, how.cwd):
                    return Outcome(stopped=True)
            rank0 = how.rdzv is None or folder.process_group.is_file()  # rank 0 leaves it when the script ends
        except TrainingFailed:
            if how.rdzv is None:  # the failed script's files and logs are kept in the run too
                try:
                    collect_outputs(run, p.collect, launched, how.cwd)
                except Exception as e:  # noqa: BLE001 - the script's own failure is what the run ends with
                    get_run_logger().warning("the failed script's files were not all kept in the run: %s",
                                             one_line(e))
            raise
        except Stopped:  # stopped while its files were collected
            return Outcome(stopped=True)
        finally:
            if how.node and not rank0:
                from gpuflow.tasks.scriptout import log_node_logs

                log_node_logs(run, how.node)
        if not rank0:
            return Outcome(rank0=False)
        return Outcome(collect_outputs(run, p.collect, launched if how.rdzv is None else None, how.cwd))

    def finish(self, s: Session, run: tracked.TrackedRun, outcome: Outcome, registered: str | None,
               summary: bool) -> str | None:
        RunFolder(run.workdir).result.write_text(json.dumps(outcome.result))  # a sweep registers its best from it
        outcome.result["world_size"] = self.params.world_size(s.plan)
        return self.register(run, outcome.result, registered) if registered else None

    def register(self, run: tracked.TrackedRun, outputs: dict, registered: str, how: str | None = None) -> str | None:
        """Register the checkpoint as a model when the script declared its class (helper.declare_model);
        `how` it was trained goes into the version's description (default: the run)."""
        return register(run, outputs, registered, self.params.script, how)


@contextmanager
def watching(run: tracked.TrackedRun, metric: str | None, report, interval: float = 1.0):
    """Read `metric`'s values from the run while the block runs (whoever logs them: the relay or
    the script itself) and give each new one to `report`; the k-th value is epoch k."""
    if report is None:
        yield
        return
    done, log = threading.Event(), get_run_logger()

    def poll() -> None:
        seen, warned, failing = 0, False, False
        while not done.wait(interval):
            try:
                history = by_step(run.client.get_metric_history(run.run_id, metric))
            except Exception as e:  # noqa: BLE001 - a store that fails a read: the next second's read may succeed
                if not failing:
                    log.warning("reading %s's %s from the tracking store failed (%s); trying again each second",
                                run.run_id, metric, one_line(e))
                failing = True
                continue
            failing = False
            for k, value in enumerate(history[seen:], start=seen):
                report(k, {metric: value})
            seen = len(history)
            if not (seen or warned) and (others := own_metrics((r := run.client.get_run(run.run_id)).data.metrics)):
                warned = True  # its first metrics, without the one optimized: most likely a misnamed metric
                log.warning(f"{r.info.run_name} has logged {', '.join(others)} but no {metric!r} so far: if it never "
                            "does, the sweep fails when the trial ends; stop it now (Ctrl-C) and optimize one of "
                            f"those, or log {metric!r} with helper.report or mlflow.log_metric")

    watcher = threading.Thread(target=copy_context().run, args=(poll,), name="gpuflow-trial-metric", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def by_step(history: list) -> list[float]:
    """A metric's values in step order, one per step: a step logged again (a restarted script ran it twice)
    counts once, with its newest value."""
    values = {m.step: m.value for m in sorted(history, key=lambda m: (m.step, m.timestamp))}
    return list(values.values())


def argument_params(args: list[str]) -> dict[str, str]:
    """A script's arguments as run params, one each, to sort and compare runs by: `--name value` and `--name=value`
    as args.<name>, a flag alone as args.<name> = true, the others as args.<position> (args.0, ...); an option given
    again keeps its last value, as argparse does. Names keep MLflow's characters and length; values its length."""
    found: dict[str, str] = {}
    positional, i = 0, 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("-") and len(arg) > 1 and not _number(arg):
            name, has, value = arg.lstrip("-").partition("=")
            if not has:
                takes = i + 1 < len(args) and (not args[i + 1].startswith("-") or _number(args[i + 1]))
                value, i = (args[i + 1], i + 1) if takes else ("true", i)
            found[_param_name(name or arg)] = value
        else:
            found[f"args.{positional}"], positional = arg, positional + 1
        i += 1
    return {k: v[:MAX_PARAM_VAL_LENGTH] for k, v in found.items()}


def _number(arg: str) -> bool:
    try:
        float(arg)
        return True
    except ValueError:
        return False


def _param_name(option: str) -> str:
    return ("args." + NOT_IN_A_NAME.sub("_", option).strip(".")).removesuffix(".")[:MAX_ENTITY_KEY_LENGTH]


NOT_IN_A_NAME = re.compile(r"[^\w.\- ]")  # MLflow's param names: letters, digits, _ . - space (and /, :, kept out)


def own_metrics(metrics: dict) -> list[str]:
    """The metrics a run logged itself: not MLflow's system metrics (`system/...`)."""
    return sorted(k for k in metrics if not k.startswith("system/"))


@task(name="collect-outputs", cache_policy=NO_CACHE)
def collect_outputs(run: tracked.TrackedRun, patterns: list[str], launched: float | None,
                    cwd: Path | None = None) -> dict:
    """Log the output folder, the `collect` files (none given: the checkpoint files the script wrote
    in its working folder during the run) and the logs; de-prefix the newest state dict
    and log it as the run's checkpoint (or log it unchanged and say why). Tag and warn about
    collected files older than `launched`, and about processes that never joined a process group."""
    from gpuflow.tasks.scriptout import flag_not_distributed, gather, written_during

    flag_not_distributed(run)
    cwd = cwd or Path.cwd()
    if not patterns and launched is not None:  # no --collect: the checkpoints it wrote during the run
        patterns = written_during(cwd, launched, run.workdir.resolve())
        if patterns:
            get_run_logger().info("collecting %s: written by the script in %s during the run (--collect names "
                                  "the files to keep instead)", ", ".join(patterns), cwd)
    return gather(run, patterns, cwd, launched)


def unregistrable(outputs: dict) -> str | None:
    """Why a script's run registers no model (what it lacks, and the fix), else None."""
    if not outputs.get("model_spec"):
        return ("declared no model: call gpuflow.training.helper.declare_model(\"module:Class\", **kwargs) in the "
                "script to register its checkpoint")
    if not outputs.get("weights"):
        return ("logged no state dict (the run's gpuflow.checkpoint tag says what it found): save "
                "model.state_dict() to a *.pt file in GPUFLOW_OUTPUT_DIR or one --collect names")
    return None


@task(name="register-model", cache_policy=NO_CACHE)
def register(run: tracked.TrackedRun, outputs: dict, registered: str, script: str, how: str | None) -> str | None:
    spec = outputs.get("model_spec")
    if why := unregistrable(outputs):
        get_run_logger().info("no model registered: the script %s", why)
        return None
    description = f"{spec['reference']} trained by {Path(script).name} {how or f'(run {run.run_id})'}"
    if not outputs.get("input_example"):
        get_run_logger().info("model registered without a signature: declare it with an example batch "
                              "(helper.declare_model(..., input_example=x)) for one")
    return results.register_model(run, {"model_spec": spec, "weights": outputs["weights"],
                                        "input_example": outputs.get("input_example")}, registered,
                                  str(Path.cwd()), description)
