"""A sweep's search space: the YAML file that names run parameters (and `model_args.<key>`) with
their distributions, read and checked before any trial starts (flows/sweep.py samples it)."""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Iterable, Literal

import yaml
from pydantic import BaseModel, ValidationError, model_validator

from gpuflow.training.config import KNOWN_METRICS, Training
from gpuflow.training.errors import UserError

from .calls import one_line

# A served deployment's caller names the space file, so its reading is bounded before anything else.
MAX_SPACE_BYTES = 1 << 20  # a space is a few lines; more is the wrong file or an attack
MAX_PARAMETERS = 100  # every parameter is checked and sampled per trial; more is no search Optuna can do
MAX_CHOICES = 1000  # every choice is validated as a run's value before the sweep starts
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml, when built: faster, and it bounds nesting


class SweepError(UserError):
    """A space, objective or parallelism the sweep cannot run; the message names the value."""


class Distribution(BaseModel):
    """One parameter's distribution: float or int in [low, high] (log-scaled with log), or a choice."""

    type: Literal["float", "int", "choice", "loguniform"]
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False
    values: list[Any] | None = None

    @model_validator(mode="after")
    def _range(self):
        if self.type == "loguniform":
            self.type, self.log = "float", True
        if self.type == "choice":
            if not self.values:
                raise ValueError("a choice needs a non-empty `values` list")
            return self
        if self.low is None or self.high is None:
            raise ValueError(f"a {self.type} range needs `low` and `high`")
        if self.low >= self.high:
            raise ValueError(f"the range [{self.low}, {self.high}] is empty or inverted; use low < high")
        if self.log and self.low <= 0:
            raise ValueError(f"a log-scaled range needs low > 0, got {self.low}")
        if self.type == "int" and not (float(self.low).is_integer() and float(self.high).is_integer()):
            raise ValueError(f"an int range needs whole bounds, got [{self.low}, {self.high}]")
        if self.step is not None:  # what Optuna's suggest would refuse at the first trial
            if self.step <= 0 or (self.type == "int" and not float(self.step).is_integer()):
                raise ValueError(f"step {self.step} must be above 0{' and whole' if self.type == 'int' else ''}")
            if self.log and (self.type == "float" or self.step != 1):
                raise ValueError(f"a log-scaled range takes no step (got step {self.step}); drop one of them")
        return self

    def suggest(self, trial, name: str):
        if self.type == "choice":
            return trial.suggest_categorical(name, self.values)
        if self.type == "int":
            return trial.suggest_int(name, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(name, self.low, self.high, step=self.step, log=self.log)

    def examples(self) -> list:
        """The values that bound what this distribution can give (checked against the parameter)."""
        if self.type == "choice":
            return list(self.values)
        return [int(self.low), int(self.high)] if self.type == "int" else [self.low, self.high]


SWEEPABLE = sorted(set(Training.model_fields) - {"resume", "data_root", "download"})


def read_space(path: str) -> dict[str, Distribution]:
    """The space file (YAML or JSON), bounded in size, anchors, parameters and choices, each distribution checked."""
    raw = _load(_read_bounded(path), path)
    if not isinstance(raw, dict) or not raw:
        raise SweepError(f"space={path} must map parameter names to distributions, e.g. "
                         "`lr: {type: float, low: 1.0e-4, high: 0.1, log: true}`")
    _check_counts(raw, path)
    space = {}
    for name, spec in raw.items():
        try:
            space[str(name)] = Distribution.model_validate(spec)
        except ValidationError as e:
            raise SweepError(f"space={path}: {name}: {one_line(e)}") from None
    return space


def _read_bounded(path: str) -> bytes:
    """The file's bytes; a file over MAX_SPACE_BYTES is refused without reading the rest."""
    with open(path, "rb") as f:
        data = f.read(MAX_SPACE_BYTES + 1)
        size = max(os.fstat(f.fileno()).st_size, len(data))
    if size > MAX_SPACE_BYTES:
        raise SweepError(f"space={path} is {size:,} bytes, over the {MAX_SPACE_BYTES:,} a space file may have; "
                         "a space names a few distributions: check that this is the space file")
    return data


def _load(data: bytes, path: str) -> Any:
    """The YAML document, refused at its first anchor or alias before anything is built from it."""
    try:
        _refuse_anchors(yaml.parse(data, Loader=LOADER), path)
        return yaml.load(data, Loader=LOADER)
    except (yaml.YAMLError, ValueError, RecursionError) as e:  # ValueError: an int too long for Python
        raise SweepError(f"space={path}: not YAML ({one_line(e)})") from None


def _refuse_anchors(events: Iterable[yaml.Event], path: str) -> None:
    """Refuses the first anchor or alias: aliases repeat a node, so a few lines can expand to billions."""
    for event in events:
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            kind = f"alias *{anchor}" if isinstance(event, yaml.AliasEvent) else f"anchor &{anchor}"
            raise SweepError(f"space={path}: line {event.start_mark.line + 1} has the YAML {kind}; a space file takes "
                             "no anchors or aliases (they can expand to billions of values): write the values out")


def _check_counts(raw: dict, path: str) -> None:
    """At most MAX_PARAMETERS parameters, each with at most MAX_CHOICES choices."""
    if len(raw) > MAX_PARAMETERS:
        raise SweepError(f"space={path} names {len(raw):,} parameters, over the {MAX_PARAMETERS} a sweep may "
                         "search; keep the ones that matter and set the rest as the run's own parameters")
    for name, spec in raw.items():
        values = spec.get("values") if isinstance(spec, dict) else None
        if isinstance(values, list) and len(values) > MAX_CHOICES:
            raise SweepError(f"space={path}: {name} has {len(values):,} choices, over the {MAX_CHOICES:,} one "
                             "parameter may have; keep the ones that matter, or search a range (type: int or float)")


def with_values(base: dict, values: dict) -> dict:
    """The run's parameters with a trial's values (`model_args.<key>` goes into model_args)."""
    out = {**base, "model_args": dict(base.get("model_args") or {})}
    for name, v in values.items():
        if name.startswith("model_args."):
            out["model_args"][name.split(".", 1)[1]] = v
        else:
            out[name] = v
    return out


def check_space(space: dict[str, Distribution], base: dict, path: str, validate: Callable[[dict], Any],
                all_fields: Iterable[str]) -> None:
    """Every name a parameter a trial may set, every distribution one it can take, every bound
    a value the run accepts (`validate` builds a run's parameters): refused before any trial starts."""
    for name, dist in space.items():
        field_name = "model_args" if name.startswith("model_args.") else name
        if field_name not in SWEEPABLE:
            hint = "; gpuflow sets the devices, tracking and placement of each trial" if name in all_fields else ""
            raise SweepError(f"space={path}: {name!r} is not a parameter a trial can set{hint}; use "
                             f"{', '.join(SWEEPABLE)} or model_args.<key>")
        annotation = Training.model_fields[field_name].annotation
        if dist.type == "float" and annotation is int:
            raise SweepError(f"space={path}: {name} takes whole numbers but the space gives it a float "
                             f"distribution; use type: int")
        for v in dist.examples():
            try:
                validate(with_values(base, {name: v}))
            except ValidationError as e:
                raise SweepError(f"space={path}: {name}={v!r} is not a value a run accepts: {one_line(e)}") from None


def check_metric(objective: str, metric: str) -> None:
    """A built-in objective's metrics are known; a user objective's are checked at its first epoch."""
    known = KNOWN_METRICS.get(objective)
    if known is not None and metric != "auto" and metric not in known:
        raise SweepError(f"optimize={metric!r}: objective {objective!r} reports no such metric; "
                         f"use auto or one of {', '.join(sorted(known))}")


PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_.-]*)\}")


def script_arguments(args: list[str], values: dict) -> list[str]:
    """A script trial's arguments: each `{name}` replaced by the trial's value of name; a name with
    no placeholder appended as `--name=value`."""
    used = {m for a in args for m in PLACEHOLDER.findall(a)}
    out = [PLACEHOLDER.sub(lambda m: str(values.get(m.group(1), m.group(0))), a) for a in args]
    return out + [f"--{n}={v}" for n, v in values.items() if n not in used]


def check_script_space(space: dict[str, Distribution], args: list[str], path: str) -> None:
    """A script's space names the script's own arguments: any name an option can have; every
    placeholder in its arguments must be one of them."""
    for name in space:
        if not PLACEHOLDER.fullmatch("{" + name + "}"):
            raise SweepError(f"space={path}: {name!r} cannot name a script argument; use letters, digits, "
                             "'_', '-' or '.', starting with a letter or '_'")
    for a in args:
        for name in PLACEHOLDER.findall(a):
            if name not in space:
                raise SweepError(f"script_args: {{{name}}} in {a!r} is not in space={path}; add {name} to "
                                 f"the space or remove the placeholder (the space names {', '.join(space)})")
