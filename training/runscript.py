"""`torchrun ... -m gpuflow.training.runscript train.py ARGS...`: a user's script, run as `python train.py ARGS...`
would run it, with whole output lines, the run's --dist-timeout-s as default collective timeout, its error left
for the flow (not run again after a failure without progress), and a warning when its ranks join no group."""

from __future__ import annotations

import os
import runpy
import sys
import threading
import time
import traceback
from pathlib import Path

from . import contract
from .compat import set_default_pg_timeout
from .contract import ranks


def _set_dist_timeout() -> float | None:
    seconds = os.environ.get(contract.DIST_TIMEOUT_ENV)
    if not seconds:
        return None
    set_default_pg_timeout(float(seconds))
    return float(seconds)


def _timeout_hint(exc: BaseException, seconds: float | None) -> str:
    text = str(exc).lower()
    if seconds is None or not ("timed out" in text or "timeout" in text):
        return ""
    return (f" [a collective waited longer than the run's collective timeout ({seconds:g} s, --dist-timeout-s): "
            "a rank is stuck, gone, or skipped a collective the others entered; raise --dist-timeout-s if "
            "such waits are expected]")


class ProcessGroupWatch:
    """On rank 0 of several: whether the script ever joins a process group, polled on a thread (torch announces
    no join), so a group that lives only milliseconds can be missed."""

    POLL_S = 0.01  # cheap: a flag read

    def __init__(self, script: str, world_size: int, grace_s: float):
        import torch.distributed as dist

        self.script, self.world_size, self.grace_s = script, world_size, grace_s
        self._initialized = dist.is_initialized
        self._joined, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._watch, name="gpuflow-process-group-watch", daemon=True)
        self._thread.start()

    @classmethod
    def start_for(cls, script: str) -> "ProcessGroupWatch | None":
        """A watch when this is global rank 0 of several processes that can join a group, else None."""
        here = ranks()
        if here.world_size < 2 or not here.is_main:
            return None
        import torch.distributed as dist

        if not dist.is_available():
            return None
        grace = float(os.environ.get(contract.JOIN_GRACE_ENV) or contract.JOIN_GRACE_S)
        return cls(Path(script).name, here.world_size, grace)

    def _watch(self) -> None:
        started, warned = time.monotonic(), False
        while not self._stop.wait(self.POLL_S):
            if self._initialized():
                self._joined.set()
                if warned:
                    print(f"[gpuflow] {self.script} joined a process group after all: ignore the warning above",
                          file=sys.stderr)
                return
            if not warned and time.monotonic() - started >= self.grace_s:
                print(f"[gpuflow] warning: {contract.not_distributed(self.script, self.world_size, self.grace_s)}",
                      file=sys.stderr)
                warned = True

    def finish(self, record: bool) -> None:
        """Stop watching; when the script ended well (`record`), leave whether it joined for the flow."""
        self._stop.set()
        self._thread.join()
        if record:
            contract.write_process_group(self.script, self.world_size, self._joined.is_set() or self._initialized())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m gpuflow.training.runscript SCRIPT.py [ARGS...]", file=sys.stderr)
        return 2
    contract.whole_lines()
    if contract.replay_deterministic():
        return 1
    script = str(Path(argv[0]).resolve())
    timeout = _set_dist_timeout()
    sys.argv = [argv[0], *argv[1:]]
    sys.path[0] = str(Path(script).parent)  # as `python train.py`: its own folder first
    watch = ProcessGroupWatch.start_for(script)
    started, ended_well = time.time(), False
    try:
        runpy.run_path(script, run_name="__main__")
        ended_well = True
    except SystemExit as e:
        ended_well = e.code in (None, 0)
        raise
    except BaseException as e:  # the script's own error: report it as Python would, and leave it for the flow
        deterministic = not isinstance(e, KeyboardInterrupt) and not contract.made_progress(
            started, os.environ.get(contract.OUTPUT_DIR_ENV), top_level=os.getcwd())
        contract.write_error(e, deterministic, _timeout_hint(e, timeout))
        traceback.print_exc()
        return 1
    finally:
        flush_mlflow()
        if watch:
            watch.finish(record=ended_well)
    return 0


def flush_mlflow() -> None:
    """Write the script's queued asynchronous MLflow calls before shutdown, which would drop them ("cannot
    schedule new futures after interpreter shutdown"); only an MLflow the script imported itself."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None and hasattr(mlflow, "flush_async_logging"):
        try:
            mlflow.flush_async_logging()
        except Exception as e:  # noqa: BLE001 - the script's outcome stands; the loss is said
            print(f"gpuflow: the script's queued MLflow calls were not all written: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
