"""`python -m training.torchrun ARGS`: torchrun itself (torch.distributed.run, same ARGS).

The only difference from `torchrun ARGS` is the exit: once the workers are done and
torchrun returns normally, the launcher process leaves without the interpreter's teardown
of torch (~0.5 s on the 2-core CI machine, see training/fastexit.py), which every launch
would otherwise wait for. A failed run (ChildFailedError, a signal) exits the usual way,
with torchrun's own error report and exit code.
"""

from training import fastexit

fastexit.arm()  # before torch registers its exit handlers: this one runs last

from torch.distributed.run import main  # noqa: E402

if __name__ == "__main__":
    main()
    fastexit.exit_after_cleanup(0)
