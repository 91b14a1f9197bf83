"""Which metric judges a run, and which way is better: the one torch-free rule for the sweep, the retrain,
the space file and the worker's best checkpoint."""

from __future__ import annotations

from .config import BUILT_IN_OBJECTIVES as BUILT_IN


def monitored(objective: str, code_root: str | None = None) -> tuple[str, str]:
    """(the metric an objective monitors, its mode); a user objective's import runs its code."""
    if objective in BUILT_IN:
        return BUILT_IN[objective]
    from .objective import load_objective

    obj = load_objective(objective, code_root)
    return obj.monitor, obj.mode


def mode_of(metric: str, monitor: str, mode: str) -> str:
    """min or max for `metric` (val_ prefix aside): `mode` for the monitor, min for a loss, max for an accuracy."""
    name = metric.removeprefix("val_")
    if name == monitor:
        return mode
    if "loss" in name:
        return "min"
    if "accuracy" in name:
        return "max"
    return mode


def better(challenger: float, champion: float | None, mode: str) -> bool:
    """Strictly better by `mode` (anything is better than no champion)."""
    return champion is None or (challenger < champion if mode == "min" else challenger > champion)
