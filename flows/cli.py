"""`gpuflow`: run the training pipeline, evaluate or apply a registered model, probe the host.

    gpuflow run [--epochs 3 --gpus 3,2 --strategy dp ...]   the train pipeline flow
    gpuflow run --script train.py [--gpus 2] -- --lr 0.01   your own torchrun script (train-script flow)
    gpuflow sweep --space sweep.yaml --trials 24            Optuna search, trials in parallel (sweep flow)
    gpuflow evaluate [--version champion --gpus 3,]         loss and metrics on a split
    gpuflow infer --inputs x.pt [--version 2 --gpus cpu]    predictions for a file of inputs
    gpuflow probe [--json]                                  GPUs, versions, backends
    gpuflow server | serve | ui                             Prefect server, deployments, MLflow UI
    gpuflow node [--pool gpuflow-nodes]                     this machine as a node for `run --nodes N`
    gpuflow stack --data DIR                                Prefect + MLflow servers on PostgreSQL, for a team

`--gpus` means the same everywhere: auto, cpu, a count ('2'), or physical ids ('3,2';
'3,' is GPU 3 alone). Every option of `run` is a parameter of the flow and of its
deployments (`prefect deployment run 'train-pipeline/ddp' -p epochs=3`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import signal
import sys
import typing

from pydantic import BaseModel, ValidationError

from gpuflow.tasks.launch import TrainingFailed
from gpuflow.training.errors import UserError
from gpuflow.training.lifetime import exit_on_sigterm

from .api import STARTUP_TIMEOUT_DEFAULT_S, STARTUP_TIMEOUT_ENV, prefect_api, server_environment, temporary_api
from .calls import admit, one_line, quiet_libraries, report_user_errors_once, validated, validated_once
from .options import add_model, rest_field

from .params import EvaluateParams, InferParams, PipelineParams, ScriptParams, SweepParams
from .settings import NodeService, Settings, server_command, ui_command, ui_environment
from .stack import StackService

quiet_libraries()  # before MLflow is imported, which reads its logging level once
# Prefect's queues of events and log lines say at exit how many items they still send, after gpuflow's last line
for _queue in ("EventsWorker", "APILogWorker"):
    logging.getLogger(_queue).setLevel(logging.ERROR)
os.environ.setdefault(STARTUP_TIMEOUT_ENV, str(STARTUP_TIMEOUT_DEFAULT_S))  # for every server a command starts

SCRIPT_EPILOG = """\
Your own torchrun script instead of gpuflow's training loop (the train-script flow):

    gpuflow run --script train_ddp.py --gpus 2 -- --lr 0.01 --epochs 5

Everything after -- goes to the script. `gpuflow run --script X.py --help` lists the options
that apply then (devices, restarts, tracking, --collect); docs/scripts.md says what the script
gets (MLFLOW_RUN_ID, GPUFLOW_OUTPUT_DIR) and the helper.
"""


def parser(script: bool = False) -> argparse.ArgumentParser:
    """The CLI; with `script`, `run` takes the train-script flow's options (ScriptParams)."""
    top = argparse.ArgumentParser(prog="gpuflow", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="command", required=True)
    kw = dict(argument_default=argparse.SUPPRESS)
    run_help = ("run the train pipeline flow, or your own script with --script (ephemeral Prefect API unless "
                "PREFECT_API_URL is set; MLflow in ./mlflow.db unless MLFLOW_TRACKING_URI)")
    run = sub.add_parser("run", help=run_help, epilog=None if script else SCRIPT_EPILOG,
                         formatter_class=argparse.RawDescriptionHelpFormatter, **kw)
    if not script:
        run.add_argument("--script", metavar="SCRIPT.py", help="run your own torchrun script instead (see below)")
    add_model(run, ScriptParams if script else PipelineParams)
    add_model(sub.add_parser("sweep", help="search a run's parameters with Optuna: parallel trials on separate "
                             "cards, pruned early, one parent MLflow run, the best model proposed as challenger "
                             "(the sweep flow)", **kw), SweepParams)
    add_model(sub.add_parser("evaluate", help="loss and metrics (accuracy, or your objective's) of a registered "
                             "version on one device (the evaluate-model flow)", **kw), EvaluateParams)
    add_model(sub.add_parser("infer", help="predictions of a registered version for a file of inputs, "
                             "on one device", **kw), InferParams)
    probe = sub.add_parser("probe", help="print GPUs, driver/CUDA/NCCL versions and backends")
    probe.add_argument("--json", action="store_true", help="machine-readable output")
    for name, what in SERVICES.items():
        model = {"node": NodeService, "stack": StackService}.get(name, Settings)
        add_model(sub.add_parser(name, help=what + (" (settings: options, or GPUFLOW_<NAME> variables)"
                                                    if model is Settings else ""), **kw), model, USES.get(name))
    return top


USES = {"server": {"prefect_host", "prefect_port"}, "ui": {"mlflow_host", "mlflow_port"}}  # of Settings; serve: all


SERVICES = {
    "stack": "a Prefect server and an MLflow tracking server on PostgreSQL, for a team to share",
    "node": "this machine as a node of a pool, for runs placed on several machines (gpuflow run --nodes N)",
    "server": "a Prefect server (API and UI) on prefect_host:prefect_port",
    "serve": "serve the deployments against the Prefect server (PREFECT_API_URL, else prefect_host:prefect_port)",
    "ui": "the MLflow UI on mlflow_host:mlflow_port over the tracking store (MLFLOW_TRACKING_URI, else ./mlflow.db)",
}


def run_service(command: str, settings) -> int:
    """Run a service in the foreground: stopping gpuflow (Ctrl-C, SIGTERM, kill -9) stops all it started."""
    from gpuflow.training.reaper import run_supervised

    if command == "stack":
        from .stack import serve_stack

        return serve_stack(settings)
    if command == "node":
        from .serve import serve_node

        return serve_node(settings)
    if command == "serve":
        from .serve import main as serve

        serve(settings)
        return 0
    if command == "server":
        return run_supervised(server_command(settings), env=server_environment())  # leases any server on its home sees
    from gpuflow.tasks.tracking.store import default_tracking_uri, training_view_urls

    for url in training_view_urls(default_tracking_uri(), settings.mlflow_ui_url):  # the UI itself opens on GenAI
        print(f"gpuflow: training runs at {url}", file=sys.stderr)
    return run_supervised(ui_command(settings), env=ui_environment(default_tracking_uri()))


def parse(argv: list[str], p: argparse.ArgumentParser | None = None) -> tuple[str, type[BaseModel] | None, dict]:
    """(command, its parameter model, the values given); arguments after `--` go to a REST field."""
    rest: list[str] | None = None
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    script = any(a == "--script" or a.startswith("--script=") for a in argv)
    p = p or parser(script)
    ns = vars(p.parse_args(argv))
    command, model = ns.pop("command"), ns.pop("_model", None)
    if rest is not None:
        target = rest_field(model) if model else None
        if target is None:
            p.error(f"`gpuflow {command}` takes no arguments after --")
        ns[target] = rest
    return command, model, ns


def print_report(report) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.print(f"[bold]{report.hostname}[/]: {report.cpu_count} CPUs (GPU facts from: {report.source})")
    for label in ("torch", "CUDA", "cuDNN", "NCCL", "driver"):
        con.print(f"  {label}: {report.version(label.lower())}", highlight=False)
    con.print("backends: " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in report.backends.items()))
    con.print(f"inherited CUDA_VISIBLE_DEVICES={report.cuda_visible_devices or 'unset'} "
              f"CUDA_DEVICE_ORDER={report.cuda_device_order or 'unset'}", highlight=False)
    if not report.gpus:
        con.print("no GPUs: training runs on the CPU (DDP over gloo)")
    else:
        t = Table("id", "name", "cc", "free / total MiB", "util %", "procs", "PCI bus", "uuid")
        for g in report.gpus:
            t.add_row(str(g.index), g.name, g.compute_capability,
                      f"{g.memory_free_mb} / {g.memory_total_mb}", str(g.utilization_pct),
                      str(g.processes), g.pci_bus_id, g.uuid)
        con.print(t)
    for w in report.warnings:
        con.print(f"[yellow]warning:[/] {w}")


RUN_RESULT = ("run_id", "status", "model_version", "epochs_run", "world_size", "final_metrics", "checkpoint",
              "restarts", "resumed_from", "timings")


def load(command: str, model: type[BaseModel]) -> typing.Callable[[dict], dict]:
    """The command's job, its flow module (and with it MLflow) imported."""
    if model is ScriptParams:
        from .script import train_script as job
    elif command == "run":
        from .train import train_pipeline

        def job(**values) -> dict:
            out = train_pipeline(**values)
            return {k: out.get(k) for k in RUN_RESULT} | {k: out[k] for k in ("node_replacements",) if k in out}
    elif command == "sweep":
        from .sweep import sweep as job
    elif command == "evaluate":
        from .infer import evaluate_model as job
    else:
        from .infer import predict

        def job(**values) -> dict:
            return predict(InferParams(**values))
    return lambda values: job(**values)


def refuse_early(command: str, params: BaseModel) -> None:
    """What the job's first steps would refuse here, refused before a server starts or a flow run is made: this
    host's CPUs and memory, the devices a run or an evaluation asks for (assigned as the job assigns them, by
    tasks/devices/assign.py), and the store and version an evaluation reads. The job checks them again as it runs."""
    from gpuflow.tasks.devices.assign import assign_devices_for, check_host, one_device_plan
    from gpuflow.tasks.devices.probe import read_environment

    if command == "sweep":  # its trials take cards as they start
        check_host(params)
        return
    report = read_environment(with_torch=False)  # what assignment reads, without a torch process
    if command == "run":
        assign_devices_for(report, params, getattr(params, "batch_size", None), getattr(params, "precision", None))
        return
    from gpuflow.tasks.tracking import store
    from gpuflow.tasks.tracking.registry import resolve_version

    from .params import Devices

    one_device_plan(report, Devices(gpus=params.gpus))
    if not params.checkpoint:
        store.require_store(params.tracking_uri)  # reading only: never leave an empty mlflow.db behind
        resolve_version(store.open_store(params.tracking_uri), params.registered_model, params.version)


def imports_done() -> None:
    """Under `gpuflow` (imports with the collector paused: flows/__main__.py), freeze what they built; collect again."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def main(argv: list[str] | None = None) -> int:
    command, model, values = parse(sys.argv[1:] if argv is None else argv)
    try:
        if command == "probe":
            from gpuflow.tasks.devices.probe import read_environment

            report = read_environment()
            print(report.model_dump_json(indent=2)) if values["json"] else print_report(report)
            return 0
        checked = validated(model, values)  # bad values refused before anything is imported or read
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON result alone (user code may print)
            admit(checked, values)  # missing files and code that does not import, before any server starts
        if command in ("run", "sweep", "evaluate") and getattr(checked, "nodes", 1) <= 1:  # placed: each node's own
            refuse_early(command, checked)
        if command in SERVICES:
            imports_done()
            return run_service(command, checked)
        # Ctrl-C stops a run even where its starter ignored SIGINT (`cmd &`, some CI runners), as children inherit it
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # Prefect ends the flow run on SIGTERM, then calls this handler: a normal exit (143)
        exit_on_sigterm()
        api = None if command == "infer" else temporary_api()  # where one is needed it boots while the flow imports
        job = load(command, model)
        imports_done()
        with contextlib.redirect_stdout(sys.stderr):  # as above: user code may print on import, say
            if command == "infer":  # no flow: nothing to record in Prefect
                out = job(values)
            else:
                report_user_errors_once()
                with prefect_api(api), validated_once(checked):
                    out = job(values)
    except (UserError, ValidationError) as e:
        print(f"gpuflow {command}: {one_line(e)}", file=sys.stderr)
        return 2
    except TrainingFailed as e:  # the run is FAILED; its output was streamed above and is in worker.log
        print(f"gpuflow {command}: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"gpuflow {command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from gpuflow.tasks.tracking.tracked import api_lost, lost_api_message

        if not api_lost(e):
            raise
        # The run has ended; Prefect's exit hooks would retry every held event against the dead API for minutes
        print(f"gpuflow {command}: {lost_api_message(e)}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    if out is not None:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":  # `gpuflow` and `python -m gpuflow.flows` start faster (flows/__main__.py)
    sys.exit(main())
