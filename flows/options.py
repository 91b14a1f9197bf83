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


def _cli(field) -> str | None:
    """The field's `cli` mark: REST, RANGE or none."""
    extra = field.json_schema_extra
    return extra.get("cli") if isinstance(extra, dict) else None


def add_field(p: argparse.ArgumentParser, name: str, field) -> None:
    """One option for one declared field: its type, choices, default and help."""
    if _cli(field) == REST:
        return  # filled from the arguments after `--` (cli.parse)
    flag = "--" + name.replace("_", "-")
    kind = field.annotation
    default = "required" if field.is_required() else f"default: {json.dumps(field.default)}"
    option = dict(dest=name, help=f"{field.description or ''} ({default})".strip())
    container = next((c for c in (dict, list) if origin_is(kind, c)), None)
    if _cli(field) == RANGE:
        p.add_argument(flag, type=lambda t: int(t) if t.strip().isdigit() else t, metavar="N|MIN:MAX", **option)
    elif kind is bool:
        p.add_argument(flag, action=argparse.BooleanOptionalAction, **option)
    elif typing.get_origin(kind) is typing.Literal:
        p.add_argument(flag, choices=list(typing.get_args(kind)), **option)
    elif container:
        p.add_argument(flag, type=_json_arg(flag, container), metavar="JSON", **option)
    else:
        base = next((a for a in (kind, *typing.get_args(kind)) if a in (int, float, str)), str)
        p.add_argument(flag, type=base, metavar=name.upper(), required=field.is_required(), **option)


def add_model(p: argparse.ArgumentParser, model: type[BaseModel], only: set[str] | None = None) -> None:
    """`model`'s fields as options (`only` these, where given)."""
    for name, field in model.model_fields.items():
        if only is None or name in only:
            add_field(p, name, field)
    p.set_defaults(_model=model)


def rest_field(model: type[BaseModel]) -> str | None:
    return next((n for n, f in model.model_fields.items() if _cli(f) == REST), None)
