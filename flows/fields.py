"""The field types of gpuflow's parameters (flows/params.py declares the tree of them): each a type with its
bounds, help and a pure check. No check reads a file: a path is only made absolute, and the files a field marks
`Exists` are checked at the job's door (flows/calls.py `admit`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field

from gpuflow.tasks.devices.assign import one_device
from gpuflow.training.config import Exists, absolute
from gpuflow.training.errors import UserError

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._-]{0,99}")
URI_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql", "http", "https", "file", "databricks")


def check_name(v: str) -> str:
    """Names become folders, registry queries and UI links: a safe alphabet only."""
    if not NAME.fullmatch(v) or ".." in v:
        raise ValueError("not a usable name: use up to 100 letters, digits, spaces, '.', '_' "
                         "or '-', starting with a letter or digit (no '/', quotes or '..')")
    return v


def check_tracking_uri(v: str | None) -> str:
    """The store's URI; unset, resolved once here for the whole run (MLFLOW_TRACKING_URI, else ./mlflow.db)."""
    if v is None:
        from gpuflow.tasks.tracking.store import default_tracking_uri

        return default_tracking_uri()
    scheme = v.split(":", 1)[0].split("+", 1)[0] if ":" in v else ""
    if scheme not in URI_SCHEMES:
        hint = f"sqlite:///{os.path.abspath(v)}" if v.endswith(".db") else "sqlite:///<path>/mlflow.db"
        raise ValueError(f"not an MLflow tracking URI; use e.g. {hint}, "
                         "postgresql://user@host/db or http://host:5000")
    return v


def check_storage(v: str | None) -> str | None:
    """A study's SQLAlchemy URL, as SQLAlchemy parses it (nothing connected)."""
    if v is None:
        return v
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        make_url(v)
    except (ArgumentError, ValueError):
        raise ValueError("not a SQLAlchemy database URL; use e.g. sqlite:///<path>/optuna.db or "
                         "postgresql+psycopg://user@host/db") from None
    return v


def check_version(v: str | int) -> str:
    """A version number (1 or "1": the Prefect form and `-p version=1` send a number) or 'champion'."""
    v = str(v)
    if not (v.isdigit() and int(v) > 0) and v != "champion":
        raise ValueError("not a version: use a registered version number (1, 2, ...) or 'champion'")
    return v


def check_one_device(v: str) -> str:
    try:
        return one_device(v)
    except UserError as e:
        raise ValueError(str(e)) from None


TrackingUri = Annotated[str | None, AfterValidator(check_tracking_uri),
                        Field(description="MLflow URI (default: MLFLOW_TRACKING_URI, else "
                              "sqlite:///<working directory>/mlflow.db)", validate_default=True)]
Name = Annotated[str, AfterValidator(check_name)]
RegisteredModel = Annotated[Name, Field(description="Model Registry name")]
Version = Annotated[str | int, AfterValidator(check_version),
                    Field(description="a registered version number, or 'champion'")]
OneDevice = Annotated[str, AfterValidator(check_one_device),
                      Field(description="the one device: auto, cpu, 1 (the freest GPU), or a physical id like 3,")]
NO_SUCH_FILE = Exists("no such file ({path}); check the path")
InputFile = Annotated[str | None, AfterValidator(lambda v: v and absolute(v)), NO_SUCH_FILE]


def check_endpoint(v: str | None) -> str | None:
    host, _, port = (v or "").rpartition(":")
    if v is not None and not (host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError("not host:port; use node 0's address and a free port, e.g. 10.0.0.5:29500")
    return v


def check_parallel(v: str | int) -> str:
    """auto or a count; a number as the Prefect form and `-p parallel=2` send it, or as text."""
    v = str(v).strip()
    if v != "auto" and not (v.isdigit() and int(v) >= 1):
        raise ValueError(f"parallel={v!r}: use auto or a number of trials at a time, like 2")
    return v


def check_script(v: str) -> str:
    path = Path(absolute(v))
    if path.suffix not in ("", ".py"):  # none: a folder, refused as one when the job is entered
        raise ValueError(f"{path.name} is not a Python file; torchrun runs a .py script")
    return str(path)


SCRIPT = Exists("no such file ({path}); give the path of your training script, e.g. train_ddp.py",
                folder="{path} is a directory; give the path of your training script in it, e.g. {path}/train.py")
ScriptFile = Annotated[str, AfterValidator(check_script), SCRIPT]
ScriptArgs = Annotated[list[str], Field(
    description="the script's own arguments (on the command line: everything after --); in a sweep, {name} "
    "in them is replaced by the trial's value of name, and a name without a placeholder is appended as "
    "--name=value", json_schema_extra={"cli": "rest"})]


def check_collect(patterns: list[str]) -> list[str]:
    """Glob patterns that stay inside the working folder: relative, no '..' ('**/..' climbs out too); raises
    ValueError. Each match is checked again, by its real path, when it is logged."""
    for pattern in patterns:
        path = Path(pattern)
        if not pattern.strip() or path.is_absolute() or pattern.startswith("~") or ".." in path.parts:
            raise ValueError(f"collect pattern {pattern[:200]!r} must be a glob relative to the working folder "
                             "that stays inside it (no leading '/' or '~', no '..'), e.g. 'snapshot.pt' or "
                             "'checkpoints/*.pt'")
    return patterns


Collect = Annotated[list[str], AfterValidator(check_collect), Field(description=(
    "glob patterns, relative to the working folder and staying inside it, of files the script writes "
    "outside GPUFLOW_OUTPUT_DIR to log as artifacts (e.g. [\"snapshot.pt\"]); the newest state dict "
    "among them is the run's checkpoint"))]
