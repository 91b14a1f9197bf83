"""gpuflow's public flows: Prefect flows whose keywords are one model's fields, a misspelled one refused in one
line that names the closest."""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Callable

from prefect import Flow
from pydantic import BaseModel

from .calls import InvalidParameters, flat_parameters


class CheckedFlow(Flow):
    """A Prefect flow whose call refuses a keyword it does not take, naming the closest it does."""

    def __call__(self, *args, **kwargs):
        names = list(inspect.signature(self.fn).parameters)
        unknown = [k for k in kwargs if k not in names and k not in ("return_state", "wait_for")]
        if unknown:
            raise InvalidParameters("; ".join(
                f"{k}={kwargs[k]!r}: {self.fn.__name__} takes no parameter {k!r}"
                + "".join(f"; did you mean {m}?" for m in difflib.get_close_matches(k, names, 1)) for k in unknown))
        return super().__call__(*args, **kwargs)


def checked_flow(model: type[BaseModel], **options: Any) -> Callable[[Callable[[Any], Any]], CheckedFlow]:
    """`@flow(**options)` over `@flat_parameters(model)`: the flow validates its values itself, once."""

    def wrap(fn: Callable[[Any], Any]) -> CheckedFlow:
        return CheckedFlow(flat_parameters(model)(fn), validate_parameters=False, **options)

    return wrap
