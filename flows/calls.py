"""What every gpuflow flow does when called, by the CLI, a deployment or a user's own flow: the operator's policy
in served runs, bad values refused in one line (`InvalidParameters`), MLflow kept quiet, a Ctrl-C ended in one
line, and a warning when it runs on Prefect's own temporary API.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
import os
import sys
from typing import Annotated, Any, Callable, Iterator

import annotated_types
from pydantic import BaseModel, ValidationError

from gpuflow.tasks.failure import TrainingFailed
from gpuflow.training.config import Exists
from gpuflow.training.errors import UserError

SHOWN = 300  # characters of a value echoed in a refusal
QUIET = {"MLFLOW_LOGGING_LEVEL": "WARNING", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
         "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}  # its "View run" links, on an HTTP store


class InvalidParameters(UserError, ValueError):
    """A flow's parameters failed validation; the message is one line per the CLI's format."""


def cut(text: str, keep: int = SHOWN) -> str:
    """`text`, or its start and end around how much was cut: a refusal stays one line and keeps its fix."""
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
    """`model(**values)`, whose validators are pure (no file read, nothing imported, no host asked); else
    InvalidParameters in the one line the CLI prints."""
    try:
        return model(**values)
    except ValidationError as e:
        raise InvalidParameters(one_line(e)) from None


def admit(params: BaseModel, values: dict | None = None) -> BaseModel:
    """The door every job's parameters pass once, before the job reads or runs anything they name: the operator's
    policy in a served deployment's run (flows/allow.py), each file a field marks `Exists` there, the model's
    `check_contents`, each code reference resolving (nothing called). `values`, as typed, word the refusals."""
    from gpuflow.training.refs import check_references

    from .allow import check_allowed

    check_allowed(params)
    for name, field in type(params).model_fields.items():
        value = getattr(params, name)
        given = (values or {}).get(name, value)
        for mark in (m for m in field.metadata if isinstance(m, Exists)):
            if isinstance(value, str) and (why := mark.refusal(value, given)):
                raise InvalidParameters(f"{name}={cut(repr(given), SHOWN // 2)}: {cut(why)}")
    if hasattr(params, "check_contents"):
        params.check_contents()
    check_references(params)
    return params


def quiet_libraries() -> None:
    """MLflow at WARNING and no progress bars, unless the caller set these variables itself."""
    for name, value in QUIET.items():
        os.environ.setdefault(name, value)
    if "mlflow" in sys.modules and os.environ["MLFLOW_LOGGING_LEVEL"] == QUIET["MLFLOW_LOGGING_LEVEL"]:
        logging.getLogger("mlflow").setLevel(logging.WARNING)  # MLflow read the variable when imported


PREFECTS_END = "Finished in state "  # how Prefect's engines log a run's end, its failure's message in it


class UserErrorOnce(logging.Filter):
    """Drops Prefect's records of a user error or training failure that gpuflow says in one line: the failed task's
    or flow's traceback, and each "Finished in state Failed(...)" repeating it."""

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, (UserError, TrainingFailed)):
            self.messages.append(str(error).splitlines()[0])
            return False
        said = record.getMessage()
        return not (said.startswith(PREFECTS_END) and any(m in said for m in self.messages))


def report_user_errors_once(loggers: tuple[str, ...] = ("",)) -> None:
    """The filter on the handlers of `loggers` (the root's: the console)."""
    import prefect  # noqa: F401  (its logging setup puts the console handler on the root logger)

    once = UserErrorOnce()
    for name in loggers:
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(once)


@functools.cache  # once a process: the flow runs it holds share the one filter
def _report_flow_runs_user_errors_once() -> None:
    report_user_errors_once(("", "prefect.flow_runs", "prefect.task_runs"))


def in_a_deployment_run() -> bool:
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return ctx is not None and ctx.flow_run is not None and ctx.flow_run.deployment_id is not None


def said_once_in_a_deployment_run(e: BaseException) -> None:
    """In a deployment's run, log why it fails (a user error or a training failure) once, in one line: Prefect's
    own records of it (the failed task's traceback, each "Finished in state Failed") were dropped from the serve
    terminal and the run's log since the run began (`entered`)."""
    from prefect import get_run_logger

    if not in_a_deployment_run():
        return
    _report_flow_runs_user_errors_once()
    get_run_logger().error(one_line(e) if isinstance(e, UserError) else str(e).splitlines()[0])


INTERRUPTED = "gpuflow: interrupted; the training it started has stopped"


def interrupted_in_one_line() -> None:
    """A Ctrl-C that ends a user's own flow's process prints one line, not a traceback through Prefect's engine."""
    previous = sys.excepthook
    if getattr(previous, "gpuflow", False):
        return

    def hook(kind, value, tb):
        if issubclass(kind, KeyboardInterrupt):
            print(INTERRUPTED, file=sys.stderr)
        else:
            previous(kind, value, tb)

    hook.gpuflow = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def warn_on_prefects_temporary_api() -> None:
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        print("gpuflow: this flow runs on Prefect's own temporary API, which Ctrl-C stops before the flow can "
              "record its end; start your flow inside `with gpuflow.flows.prefect_api():`, or set "
              "PREFECT_API_URL to a server", file=sys.stderr, flush=True)


# Parameters a caller validated already (the CLI, retrain), which the flow it calls next takes as they are.
_VALIDATED: contextvars.ContextVar[BaseModel | None] = contextvars.ContextVar("gpuflow_validated", default=None)


@contextlib.contextmanager
def validated_once(params: BaseModel) -> Iterator[None]:
    """The next flow entered in this block with `params`' model takes `params` as they are (validated and
    admitted by the caller)."""
    token = _VALIDATED.set(params)
    try:
        yield
    finally:
        _VALIDATED.reset(token)


def entered(model: type[BaseModel], values: dict) -> BaseModel:
    """A flow's first step: its parameters validated and admitted (`admit`), or taken as its caller (the CLI,
    retrain) validated and admitted them (`validated_once`)."""
    given = _VALIDATED.get()
    if type(given) is model:
        _VALIDATED.set(None)  # once: a flow this one calls validates its own values
        params = given
    else:
        params = admit(validated(model, values), values)
    quiet_libraries()
    if in_a_deployment_run():  # before any task: a task that fails is logged with its traceback as it fails
        _report_flow_runs_user_errors_once()
    interrupted_in_one_line()
    warn_on_prefects_temporary_api()
    return params


def _schema_type(field) -> Any:
    """The field's type with its bounds, for the Prefect form (validation stays with the model)."""
    bounds = [m for m in field.metadata if isinstance(m, annotated_types.BaseMetadata)]
    return Annotated[(field.annotation, *bounds)] if bounds else field.annotation


def flat_parameters(model: type[BaseModel]) -> Callable[[Callable[[Any], Any]], Callable[..., Any]]:
    """Give `fn(params: model)` the flat keyword signature of `model`'s fields, and their descriptions as Args
    (Prefect builds a flow's parameters and UI form from them); the call validates the values once."""
    fields = model.model_fields

    def wrap(fn: Callable[[Any], Any]) -> Callable[..., Any]:
        def flat(**values):
            try:
                return fn(entered(model, values))
            except (UserError, TrainingFailed) as e:
                said_once_in_a_deployment_run(e)
                raise

        flat.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                               default=inspect.Parameter.empty if f.is_required() else f.default,
                               annotation=_schema_type(f)) for name, f in fields.items()],
            return_annotation=inspect.signature(fn).return_annotation)
        args = "\n".join(f"    {name}: {(f.description or name).strip()}" for name, f in fields.items())
        flat.__doc__ = f"{inspect.getdoc(fn) or ''}\n\nArgs:\n{args}\n"
        flat.__name__, flat.__qualname__, flat.__module__ = fn.__name__, fn.__qualname__, fn.__module__
        return flat

    return wrap
