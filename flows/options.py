"""The `gpuflow` command's options, derived from the flows' parameter models (flows/params.py):
one option per field, with its type, choices, default and help; JSON for dicts and lists; the
field marked `cli: rest` takes every argument after `--`."""

from __future__ import annotations

import argparse
import json
import typing

from pydantic import BaseModel

REST = "rest"  # json_schema_extra={"cli": REST}: the field takes every argument after `--`
RANGE = "range"  # json_schema_extra={"cli": RANGE}: an int, or MIN:MAX that the model splits


def _json_arg(flag: str, kind: type):
    example = '{"width": 512}' if kind is dict else '["--lr", "0.01"]'

    def parse(text: str):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{flag} takes JSON ({e.msg}), e.g. {example}") from None
        if not isinstance(value, kind):
            raise argparse.ArgumentTypeError(f"{flag} takes a JSON {kind.__name__}, got {text!r}")
        return value
    return parse


def origin_is(annotation, kind: type) -> bool:
    """Whether a (possibly optional) annotation is `kind` or a parametrised `kind[...]`."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return any(a is kind or typing.get_origin(a) is kind for a in (annotation, *args))


def add_field(p: argparse.ArgumentParser, name: str, field) -> None:
    """One option for one declared field: its type, choices, default and help."""
    flag = "--" + name.replace("_", "-")
    kind = field.annotation
    default = "required" if field.is_required() else f"default: {json.dumps(field.default)}"
    help_ = f"{field.description or ''} ({default})".strip()
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if extra.get("cli") == REST:
        return  # filled from the arguments after `--` (see parse)
    if extra.get("cli") == RANGE:  # N, or MIN:MAX that the model splits
        p.add_argument(flag, dest=name, type=lambda text: int(text) if text.strip().isdigit() else text,
                       metavar="N|MIN:MAX", help=help_)
        return
    if kind is bool:
        p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, help=help_)
    elif typing.get_origin(kind) is typing.Literal:
        p.add_argument(flag, dest=name, choices=list(typing.get_args(kind)), help=help_)
    elif origin_is(kind, dict) or origin_is(kind, list):
        p.add_argument(flag, dest=name, type=_json_arg(flag, dict if origin_is(kind, dict) else list),
                       metavar="JSON", help=help_)
    else:
        base = next((a for a in (kind, *args) if a in (int, float, str)), str)
        p.add_argument(flag, dest=name, type=base, metavar=name.upper(), help=help_, required=field.is_required())


def add_model(p: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    for name, field in model.model_fields.items():
        add_field(p, name, field)
    p.set_defaults(_model=model)


def rest_field(model: type[BaseModel]) -> str | None:
    return next((n for n, f in model.model_fields.items()
                 if isinstance(f.json_schema_extra, dict) and f.json_schema_extra.get("cli") == REST), None)
