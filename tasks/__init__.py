"""The flow process's steps (Prefect tasks and what they call); nothing here runs in the ranks.

  devices/   the device rules: probe the host (probe), the plan from a request (assign: physical
             and logical ids, CUDA_VISIBLE_DEVICES, the primary card, DataParallel ids, batch and
             precision checks), card locks (cards) and the host's device slot (slot)
  tracking/  MLflow: the store and its URI (store), the run a flow owns (tracked), runs left
             RUNNING by a dead flow (orphans), results and the registered model (results,
             registered_model: the pyfunc loader, requirements), champion/challenger (registry)
  data       the data step: prepare or reuse the dataset once, before any rank starts
  preflight  the preflight step: what would fail the launch, checked before any MLflow run starts
  launch     the launch step: the worker or a user's script under torchrun
  failure    a launch's failure in one line (the rank's own error, a signal, the last line)
  child      a child process of the flow under the reaper: its lines streamed, stopped in order
  scriptout  a user's script's outputs: files, logs and its checkpoint, logged with the run
"""
