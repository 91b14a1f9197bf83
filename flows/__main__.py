"""`gpuflow` and `python -m gpuflow.flows`: flows/cli.py, imported with the cyclic garbage collector paused.

Prefect, MLflow and pydantic build many objects on import that live until exit; `cli.imports_done()`
freezes them so that no later collection scans them again (bench/NOTES.md).
"""

import gc
import sys


def entry() -> int:
    gc.disable()
    from .cli import main

    code = main()
    gc.freeze()  # exit without a final collection over everything the run built
    return code


if __name__ == "__main__":
    sys.exit(entry())
