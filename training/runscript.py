"""`torchrun ... -m gpuflow.training.runscript train.py ARGS...`: a user's script, run as `python train.py ARGS...`
would run it, with whole output lines, the run's --dist-timeout-s as default collective timeout, its error left
for the flow (not run again after a failure without progress), and its first optimizer step outside a process
group refused when it runs in several processes."""

from __future__ import annotations

import os
import runpy
import sys
import threading
import time
import traceback
from pathlib import Path

from . import contract
from .cardlock import hold_card_locks
from .compat import set_default_pg_timeout
from .contract import ranks
from .errors import NotDistributed, UserError


def _set_dist_timeout() -> float | None:
    if not (seconds := os.environ.get(contract.DIST_TIMEOUT_ENV)):
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


def refuse_steps_outside_a_group(script: str):
    """On each rank of several: the first optimizer step outside a process group ends the script with the fix
    (each process would train a full copy); the hook's handle, else None."""
    here = ranks()
    if here.world_size < 2:
        return None
    import torch.distributed as dist
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def check(optimizer, args, kwargs) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise NotDistributed(contract.not_distributed(Path(script).name, here.world_size, stepping=True))

    return register_optimizer_step_pre_hook(check)


class ProcessGroupWatch:
    """On rank 0 of several: whether the script ever joins a process group, polled on a thread (torch announces
    no join), so a group that lives only milliseconds can be missed."""

    POLL_S = 0.01  # cheap: a flag read

    def __init__(self, script: str, world_size: int):
        import torch.distributed as dist

        self.script, self.world_size = script, world_size
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

        return cls(Path(script).name, here.world_size) if dist.is_available() else None

    def _watch(self) -> None:
        while not self._stop.wait(self.POLL_S):
            if self._initialized():
                self._joined.set()
                return

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
    contract.start_attempt()
    if contract.replay_deterministic():
        return 1
    if contract.replay_finished():
        return 0
    script = str(Path(argv[0]).resolve())
    try:
        hold_card_locks()  # before the script touches its card: no new run gets it until this rank is gone
    except UserError as e:
        print(f"[rank {ranks().rank}] error: {e}", file=sys.stderr, flush=True)
        contract.write_error(e, deterministic=True, located=False)
        return 2
    timeout = _set_dist_timeout()
    sys.argv = list(argv)
    sys.path[0] = str(Path(script).parent)  # as `python train.py`: its own folder first
    watch, hook = ProcessGroupWatch.start_for(script), refuse_steps_outside_a_group(script)
    started, ended_well = time.time(), False
    try:
        runpy.run_path(script, run_name="__main__")
        ended_well = True
    except SystemExit as e:
        ended_well = e.code in (None, 0)
        raise
    except BaseException as e:  # the script's own error: report it as Python would, and leave it for the flow
        deterministic = isinstance(e, NotDistributed) or not isinstance(e, KeyboardInterrupt) and not (
            contract.made_progress(started, os.environ.get(contract.OUTPUT_DIR_ENV), top_level=os.getcwd()))
        contract.write_error(e, deterministic, _timeout_hint(e, timeout))
        traceback.print_exc()
        return 1
    finally:
        if ended_well:  # first: a rank aborted as it exits can have torchrun kill this one in what follows
            contract.write_finished()
        flush_mlflow()
        if watch:
            watch.finish(record=ended_well)
        if hook:
            hook.remove()
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
