"""The flow process's steps (Prefect tasks and what they call); nothing here runs in the ranks.

  devices/   probe the host, the plan from a request (assign), card locks (cards), the host's device slot
  tracking/  MLflow: the store, the flow's run, its watcher, orphaned runs, results, the registered model, the registry
  data       prepare or reuse the dataset once, before any rank starts
  preflight  what would fail the launch, checked before any MLflow run starts
  launch     the worker or a user's script under torchrun
  failure    a launch's failure in one line
  child      a child process of the flow under the reaper: its lines streamed, stopped in order
  scriptout  a user's script's outputs: files, logs and its checkpoint, logged with the run
"""
