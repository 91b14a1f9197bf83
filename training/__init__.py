"""gpuflow's training side: torch, the standard library and the contract with the flow; it never
imports Prefect or MLflow (tests/test_layout.py checks it).

Which process runs each module:

  in the ranks (the worker, under torchrun or plain python, started by tasks/launch.py):
      __main__, trainer, distributed, checkpoint, metrics, cardlock, reproducible, faults,
      models, builder, objective, example (the registered model's example), data (loading), evaluate (gpuflow evaluate / infer's child)
  in a user's own script's ranks (gpuflow run --script):
      runscript (runs the script), helper (what the script may call), cardlock
  in both the flow and the ranks, torch-free (the flow of a built-in run never imports torch):
      config (the worker's config and the training parameters), contract (the run folder,
      GPUFLOW_* variables, the error file), refs, policy (the served door), errors, files, lifetime,
      datacache (lookup), judged (which metric judges a run, which way is better), uris (store
      URIs: the file SQLite opens), compat (other projects' bugs worked around, each with its issue)
  in the flow, with torch, only for the user's own code or data prepared the first time:
      preflight (one batch through the user's model), userdata, data (prepare), builder and
      checkpoint (an explicit resume file), statedict (a script's checkpoint, de-prefixed)
  in a process of its own between the flow and every child: reaper
"""

from .config import TrainConfig

__all__ = ["TrainConfig"]
