"""`torchrun ... -m gpuflow.training.runscript train.py ARGS...`: a user's script, run as
`python train.py ARGS...` would run it (its folder first on sys.path, `__name__ == "__main__"`,
sys.argv as given), with three things gpuflow owes it:

- each line it prints reaches the console whole (stdout and stderr flush once per line, so
  torchrun's per-rank tailing never cuts a line and two ranks' lines never merge);
- its collectives time out after the run's --dist-timeout-s (torch reads no variable for the
  default process-group timeout, so the default is set here; a timeout the script passes to
  init_process_group itself wins);
- an exception it raises is left for the flow as a structured error (training/contract.py),
  and a restart does not run it again when it failed before making any progress.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
import traceback
from pathlib import Path

from . import contract
from .metrics import OUTPUT_DIR_ENV


def _set_dist_timeout() -> float | None:
    seconds = os.environ.get(contract.DIST_TIMEOUT_ENV)
    if not seconds:
        return None
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timedelta(seconds=float(seconds))
    return float(seconds)


def _timeout_hint(exc: BaseException, seconds: float | None) -> str:
    text = str(exc).lower()
    if seconds is None or not ("timed out" in text or "timeout" in text):
        return ""
    return (f" [a collective waited longer than the run's collective timeout ({seconds:g} s, --dist-timeout-s): "
            "a rank is stuck, gone, or skipped a collective the others entered; raise --dist-timeout-s if "
            "such waits are expected]")


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
    started = time.time()
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as e:  # the script's own error: report it as Python would, and leave it for the flow
        deterministic = not isinstance(e, KeyboardInterrupt) and not contract.made_progress(
            started, os.environ.get(OUTPUT_DIR_ENV), top_level=os.getcwd())
        contract.write_error(e, deterministic, _timeout_hint(e, timeout))
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
