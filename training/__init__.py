"""gpuflow's training side: torch, the standard library and the contract with the flow; never Prefect or
MLflow (tests/test_layout.py checks it). Which process runs each module:

  in the ranks (the worker, started by tasks/launch.py): __main__, trainer, distributed, checkpoint, metrics,
      cardlock, reproducible, faults, models, builder, objective, example, data (loading), evaluate (its own child)
  in a user's own script's ranks (gpuflow run --script): runscript, helper (what the script may call), cardlock
  in both the flow and the ranks, torch-free: config, contract (run folder, GPUFLOW_* variables, error file),
      refs, policy (the served door), errors, files, lifetime, datacache (lookup; the digits, read with numpy), judged
      (which metric judges a run), uris (store URIs), compat (other projects' bugs worked around, each with its issue)
  in the flow, with torch, only for user code or a downloaded source prepared the first time: preflight, userdata,
      data (prepare), builder and checkpoint (an explicit resume file), statedict (a script's checkpoint)
  in a process of its own between the flow and every child: reaper
"""

__all__ = ["TrainConfig"]


def __getattr__(name: str):
    """TrainConfig on first use: the reaper, in front of every child a run starts, never imports pydantic."""
    if name == "TrainConfig":
        from .config import TrainConfig

        return TrainConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
