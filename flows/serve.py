"""Deployments, declared apart from the flow code, served by one process.

    make server          # terminal 1: Prefect server on 127.0.0.1:4200
    make serve           # terminal 2: this module
    .venv/bin/prefect deployment run 'train-pipeline/ddp' -p epochs=3 --watch

Deployments: train-pipeline/ddp, train-pipeline/dp, retrain/nightly (cron from
GPUFLOW_RETRAIN_CRON, default 02:00 every day, in GPUFLOW_TIMEZONE, default UTC) and
evaluate-model/evaluate. Runs on this host share one global concurrency limit, so a
scheduled retrain and a manual run never train at once: the second waits for the first.
"""

from __future__ import annotations

import os
import signal
import socket

from prefect import serve
from prefect.deployments.runner import EntrypointType
from prefect.schedules import Cron

from .infer import evaluate_model
from .retrain import retrain
from .train import DEVICE_LIMIT, train_pipeline

DEFAULT_CRON = "0 2 * * *"


def deployments(cron: str | None = None, timezone: str | None = None) -> list:
    cron = cron or os.environ.get("GPUFLOW_RETRAIN_CRON", DEFAULT_CRON)
    tz = timezone or os.environ.get("GPUFLOW_TIMEZONE", "UTC")
    # Module entrypoints (flows.train.train_pipeline): the flows use package-relative imports.
    common = dict(tags=["gpuflow"], entrypoint_type=EntrypointType.MODULE_PATH)
    return [
        train_pipeline.to_deployment(name="ddp", parameters={"strategy": "ddp"}, **common,
                                     description="One process per device (DDP; gloo on CPU)."),
        train_pipeline.to_deployment(name="dp", parameters={"strategy": "dp"}, **common,
                                     description="nn.DataParallel over the chosen GPUs (needs GPUs)."),
        retrain.to_deployment(name="nightly", schedules=[Cron(cron, timezone=tz)], **common,
                              description="Train a challenger; move 'champion' only if better."),
        evaluate_model.to_deployment(name="evaluate", **common,
                                     description="Accuracy of a registered version on one device."),
    ]


def ensure_device_limit(limit: int = 1) -> str:
    """Create (or keep) this host's global concurrency limit for device-holding runs."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    name = DEVICE_LIMIT.format(host=socket.gethostname())
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except Exception:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=limit))
    return name


def interrupt_on_ctrl_c() -> None:
    """Ctrl-C raises KeyboardInterrupt wherever the serving loop is, and serve() shuts down.

    Under asyncio.run's own SIGINT handling the first Ctrl-C only cancels the runner's main
    task, and the serve process did not return; a handler of our own keeps asyncio from
    installing that one.
    """

    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)


def main() -> None:
    ensure_device_limit()
    interrupt_on_ctrl_c()
    serve(*deployments())


if __name__ == "__main__":
    main()
