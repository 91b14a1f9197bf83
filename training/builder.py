"""Build the model a config names: a built-in (mlp, cnn, resnet18), or the user's `nn.Module` class or factory
called with `model_args` plus `num_classes` and `input_shape` when its signature names them."""

from __future__ import annotations

import inspect

from torch import nn

from . import models
from .config import BUILTIN_MODELS_MODULE
from .errors import UserError
from .refs import CodeReferenceError, describe_error, is_reference, resolve


def make_model(name: str, num_classes: int | None, input_shape, args: dict | None = None,
               code_root: str | None = None) -> tuple[nn.Module, dict]:
    """(the model, its spec {"reference", "kwargs"}: what checkpoints record to rebuild it); UserError on bad input."""
    args = args or {}
    if not is_reference(name):
        if args:
            raise UserError(f"model_args {args} apply to a model of your own; the built-in {name!r} takes none")
        attr, kwargs = models.builtin_spec(name, num_classes, tuple(input_shape))
        return getattr(models, attr)(**kwargs), {"reference": f"{BUILTIN_MODELS_MODULE}:{attr}", "kwargs": kwargs}
    target = resolve(name, code_root, "model")
    if not callable(target):
        raise CodeReferenceError(f"model {name!r} is a {type(target).__name__}, not an nn.Module class or a "
                                 "function returning one; name the class (or factory) itself")
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):  # some builtins have none: call as is
        sig = None
    known = {"num_classes": num_classes, "input_shape": list(input_shape) if input_shape is not None else None}
    kwargs = dict(args)
    if sig is not None:
        for key, value in known.items():
            if key in sig.parameters and key not in kwargs and value is not None:
                kwargs[key] = value
        try:
            sig.bind(**kwargs)
        except TypeError as e:
            raise UserError(f"model_args {args} do not fit {name} {sig}: {e}; pass only the arguments it takes "
                            "(num_classes and input_shape are filled in by gpuflow when it names them)") from None
    try:
        model = target(**kwargs)
    except Exception as e:
        raise UserError(f"model {name!r}: building it with {kwargs} raised {describe_error(e)}") from None
    if not isinstance(model, nn.Module):
        raise CodeReferenceError(f"model {name!r} returned a {type(model).__name__}, not an nn.Module; "
                                 "name an nn.Module class or a function returning a module")
    return model, {"reference": name, "kwargs": kwargs}
