"""`gpuflow` (the console script) and `python -m gpuflow.flows ...`: flows/cli.py, started with
Python's cyclic garbage collector paused while it imports.

Prefect, MLflow, SQLAlchemy and pydantic build well over a million objects on import, all of
them alive until the process ends; the collector scanned them again and again on the way in:
~0.8 s of a ~3.3 s start on 2 cores (bench/NOTES.md). Once the command's modules are in,
`cli.imports_done()` freezes those objects (no later collection scans them) and collection
resumes as usual for the run itself.
"""

import gc
import sys


def entry() -> int:
    gc.disable()
    from .cli import main

    code = main()
    gc.freeze()  # exit without the final collection over everything the run built (~1 s)
    return code


if __name__ == "__main__":
    sys.exit(entry())
