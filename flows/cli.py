"""`gpuflow`: run the training pipeline, or print what this machine offers.

    gpuflow run [--epochs 3 --gpus 3,2 --strategy dp ...]   the pipeline flow
    gpuflow probe [--json]                                  GPUs, versions, backends
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import typing

from pydantic import ValidationError

os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


def _add_field(p: argparse.ArgumentParser, name: str, field) -> None:
    flag = "--" + name.replace("_", "-")
    kind = field.annotation
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    help_ = f"{field.description or ''} (default: {field.default})".strip()
    if kind is bool:
        p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, help=help_)
    elif typing.get_origin(kind) is typing.Literal:
        p.add_argument(flag, dest=name, choices=list(typing.get_args(kind)), help=help_)
    else:
        base = next((a for a in (kind, *args) if a in (int, float, str)), str)
        p.add_argument(flag, dest=name, type=base, metavar=name.upper(), help=help_)


def parser() -> argparse.ArgumentParser:
    from .params import user_fields

    top = argparse.ArgumentParser(prog="gpuflow", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the training pipeline flow (ephemeral Prefect API unless "
                         "PREFECT_API_URL is set; MLflow in ./mlflow.db unless MLFLOW_TRACKING_URI)",
                         argument_default=argparse.SUPPRESS)
    for name, field in user_fields().items():
        _add_field(run, name, field)
    probe = sub.add_parser("probe", help="print GPUs, driver/CUDA/NCCL versions and backends")
    probe.add_argument("--json", action="store_true", help="machine-readable output")
    return top


def print_report(report) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.print(f"[bold]{report.hostname}[/]: {report.cpu_count} CPUs, torch {report.torch_version}, "
              f"CUDA {report.cuda_version}, cuDNN {report.cudnn_version}, NCCL {report.nccl_version}, "
              f"driver {report.driver_version} (source: {report.source})")
    con.print("backends: " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in report.backends.items()))
    con.print(f"inherited CUDA_VISIBLE_DEVICES={report.cuda_visible_devices!r} "
              f"CUDA_DEVICE_ORDER={report.cuda_device_order!r}")
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


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit(143).

    After the flow handles SIGTERM (run marked KILLED, workers stopped), Prefect re-sends the
    signal to the previous handler; with Python's default one the process dies on the spot,
    atexit never runs, and the ephemeral Prefect API server is left behind. This handler
    makes the exit a normal one, so that server is stopped too.
    """
    import signal

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def wants_tracker(argv: list[str]) -> bool:
    """`run` on node 0, not just asking for help: the flow will start an MLflow run."""
    rank = next((a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
                 for i, a in enumerate(argv) if a.split("=", 1)[0] == "--node-rank"), "0")
    return argv[:1] == ["run"] and not {"-h", "--help"} & set(argv) and rank.strip() in ("0", "")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if wants_tracker(argv):
        # The flow's MLflow tracker (tasks/tracker.py) loads MLflow in its own process while
        # this one loads Prefect (~1 s each). If the run never gets that far, it exits with us.
        from tasks.tracker import prestart

        prestart()
    args = vars(parser().parse_args(argv))
    command = args.pop("command")
    if command == "probe":
        from tasks.probe import read_environment

        report = read_environment()
        print(report.model_dump_json(indent=2)) if args["json"] else print_report(report)
        return 0
    from .params import PipelineParams

    try:
        PipelineParams(**args)  # refuse bad values before Prefect or torch start
    except ValidationError as e:
        print(f"gpuflow: invalid parameters:\n{e}", file=sys.stderr)
        return 2
    from .train import train_pipeline

    exit_on_sigterm()
    out = train_pipeline(**args)
    summary = {k: out.get(k) for k in ("run_id", "status", "model_version", "epochs_run",
                                       "world_size", "final_metrics", "timings")}
    print(json.dumps(summary, indent=2))
    return 0


def entry(argv: list[str] | None = None) -> int:
    """The `gpuflow` console script: main(), then leave without the interpreter's teardown."""
    from training import fastexit

    code = main(argv)
    fastexit.exit_after_cleanup(code)
    return code


if __name__ == "__main__":
    sys.exit(entry())
