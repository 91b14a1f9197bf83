"""Worker entry point: `python -m gpuflow.training --config CFG` or `torchrun ... -m gpuflow.training --config CFG`."""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import time
from pathlib import Path

from pydantic import ValidationError

from . import contract
from .cardlock import hold_card_locks
from .errors import TrainingDiverged, UserError
from .files import disk_full, write_json_atomic
from .lifetime import die_with_parent, exit_on_sigterm, leave


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m gpuflow.training",
        description="Train one model from a JSON config (see training/config.py for the fields). "
        "Under torchrun, ranks come from the environment.",
    )
    p.add_argument("--config", required=True, help="path of the TrainConfig JSON file")
    p.add_argument("--result", help="where global rank 0 writes the results JSON "
                   "(default: result.json beside the config)")
    return p.parse_args(argv)


def run(config_path: str, result_path: str | None, freeze_imports: bool = False) -> dict:
    from .config import TrainConfig
    from .metrics import MetricsFile

    cfg = TrainConfig.from_json(config_path)
    metrics = MetricsFile(is_main=contract.ranks().is_main)
    try:
        return _train(cfg, metrics, config_path, result_path, freeze_imports)
    finally:
        metrics.close()


def _train(cfg, metrics, config_path: str, result_path: str | None, freeze_imports: bool) -> dict:
    from . import data, distributed
    from .example import model_example, save_example
    from .metrics import EXAMPLE_STEM
    from .reproducible import seed_everything, set_determinism
    from .trainer import Trainer

    ctx = distributed.setup(cfg)
    trainer = None
    try:
        seed_everything(cfg.seed)
        set_determinism(cfg)
        if freeze_imports:  # the entry point only, not a caller's process (tests run this in-process)
            _freeze_imports()
        trainer = Trainer(cfg, ctx, data.load_data(cfg, fingerprint=False), metrics)
        result = trainer.train()
        if ctx.is_main:
            folder = contract.RunFolder(Path(result_path).parent if result_path else Path(config_path).parent)
            out = Path(result_path) if result_path else folder.result
            result["weights"] = str(trainer.save_weights(folder.weights))
            example, result["output_spec"] = model_example(trainer.model, trainer.bundle.val, trainer.device)
            if example is not None:
                result["input_example"] = str(save_example(folder.root / EXAMPLE_STEM, example))
            write_json_atomic(out, result)
        distributed.barrier(ctx)  # a rank tearing gloo down while rank 0 still writes can abort (SIGABRT)
        return result
    finally:
        # DDP's model and reducer hold the group: freed before it is torn down (gloo's own threads live on to `leave`)
        trainer = None
        gc.collect()
        distributed.teardown()


def _freeze_imports() -> None:
    """What the imports and the setup built lives to the end: frozen, no collection scans it again. Not the
    trainer: frozen, its DDP model and reducer would outlive the group (teardown's collection skips them)."""
    import importlib

    importlib.import_module("torch._dynamo")  # every optimizer imports it when built (135,000 objects): here, frozen
    gc.freeze()
    gc.enable()  # paused until now (__main__ below), as the CLI's (flows/__main__.py)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun: never outlive the agent
        die_with_parent(signal.SIGKILL)
    exit_on_sigterm()
    contract.whole_lines()
    contract.start_attempt()
    if contract.replay_deterministic():  # the attempt before failed the same way before any progress
        return 2
    started = time.time()
    try:
        hold_card_locks()  # before the card is touched: no new run gets it until this process is gone
        run(args.config, args.result, freeze_imports=True)
    except (UserError, ValidationError, TrainingDiverged) as e:
        return _refused(e)
    except Exception as e:  # the user's code, or a bug: its traceback, and the cause for the flow
        if full := disk_full(e):  # wherever the write was: one line, and a restart does not run it again
            return _refused(full)
        contract.write_error(e, deterministic=not contract.made_progress(started, _checkpoint_dir(args.config)))
        raise
    return 0


def _refused(e: Exception) -> int:
    """A failure that would repeat: one line, its record for the flow, and the exit code (3: diverged, else 2)."""
    print(f"[rank {contract.ranks().rank}] error: {e}", file=sys.stderr, flush=True)
    contract.write_error(e, deterministic=True, located=False)
    return 3 if isinstance(e, TrainingDiverged) else 2


def _checkpoint_dir(config_path: str) -> str | None:
    try:
        return json.loads(Path(config_path).read_text()).get("checkpoint_dir")
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    gc.disable()  # until the imports are frozen (_train)
    leave(main())  # result.json written, the checkpoint writer drained, the process group torn down
