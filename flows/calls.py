"""What every gpuflow flow does when it is called, whoever calls it: the `gpuflow` CLI, a
deployment, or a Prefect user's own flow (`train_pipeline(...)` as a subflow).

- In a served deployment's run, everything the values name passes the operator's door first.
- Bad values are refused as one line naming each value (`InvalidParameters`, a `UserError`),
  not as pydantic's multi-line report.
- MLflow's INFO chatter and artifact progress bars stay out unless asked for
  (`MLFLOW_LOGGING_LEVEL`, `MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR`), as on the CLI.
- A flow run on Prefect's own temporary API (no `PREFECT_API_URL`) is told that Ctrl-C stops
  that API before the flow can record its end, and how to avoid it (`prefect_api()`).
"""

from __future__ import annotations

import logging
import os
import sys

from pydantic import BaseModel, ValidationError

from gpuflow.training.errors import UserError

SHOWN = 300  # characters of a value echoed in a refusal
QUIET = {"MLFLOW_LOGGING_LEVEL": "WARNING", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}


class InvalidParameters(UserError, ValueError):
    """A flow's parameters failed validation; the message is one line per the CLI's format."""


def cut(text: str, keep: int = SHOWN) -> str:
    """`text`, or its start and end around how much was left out: a refusal stays one readable
    line (and keeps its fix, at the end) whatever size the value it echoes."""
    if len(text) <= 2 * keep:
        return text
    return f"{text[:keep]} ...[{len(text) - 2 * keep} characters cut]... {text[-keep:]}"


def one_line(e: BaseException) -> str:
    """A user error as one line: each bad value, what was wrong, no traceback."""
    if isinstance(e, ValidationError):
        return "; ".join((f"{'.'.join(map(str, err['loc']))}={cut(repr(err.get('input')), SHOWN // 2)}: "
                          if err["loc"] else "") + cut(err["msg"].removeprefix("Value error, "))
                         for err in e.errors())
    return cut(str(e).replace("\n", " "))


def validated(model: type[BaseModel], values: dict) -> BaseModel:
    """`model(**values)`, or InvalidParameters with the one line the CLI prints."""
    try:
        return model(**values)
    except ValidationError as e:
        raise InvalidParameters(one_line(e)) from None


def quiet_libraries() -> None:
    """MLflow at WARNING and no progress bars, unless the caller set these variables itself."""
    for name, value in QUIET.items():
        os.environ.setdefault(name, value)
    if "mlflow" in sys.modules and os.environ["MLFLOW_LOGGING_LEVEL"] == QUIET["MLFLOW_LOGGING_LEVEL"]:
        logging.getLogger("mlflow").setLevel(logging.WARNING)  # MLflow read the variable when imported


def warn_on_prefects_temporary_api() -> None:
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        print("gpuflow: this flow runs on Prefect's own temporary API, which Ctrl-C stops before the flow can "
              "record its end; start your flow inside `with gpuflow.flows.prefect_api():`, or set "
              "PREFECT_API_URL to a server", file=sys.stderr, flush=True)


def entered(model: type[BaseModel], values: dict) -> BaseModel:
    """A flow's first step: in a served run, the operator's door (flows/allow.py) on the values as
    sent, before validation reads a file or imports code; then its parameters validated, and the
    same defaults for every caller."""
    from .allow import check_allowed

    check_allowed(values)
    params = validated(model, values)
    quiet_libraries()
    warn_on_prefects_temporary_api()
    return params
