"""References to a user's own code: `package.module:Name`, imported from `code_root` as `python -m` would, or
`path/to/file.py:Name`, loaded under a module name of its own with its folder on the path. Torch-free."""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
import traceback
from pathlib import Path

from .errors import UserError

DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


class CodeReferenceError(UserError):
    """A reference to user code cannot be used; the message names it, the cause and the fix."""


def is_reference(value: str | None) -> bool:
    return bool(value) and ":" in value and not value.startswith("imagefolder:")


def split(ref: str) -> tuple[str, str]:
    """('myproj.nets', 'Net') or ('/abs/nets.py', 'Net')."""
    where, _, attr = ref.rpartition(":")
    return where, attr


def is_file_reference(ref: str) -> bool:
    where, _ = split(ref)
    return where.endswith(".py") or "/" in where


def normalize(ref: str) -> str:
    """Check a reference's form; a file reference becomes absolute (the workers run elsewhere)."""
    where, attr = split(ref)
    example = "use package.module:Name (e.g. myproj.nets:Net) or path/to/file.py:Name"
    if not DOTTED.fullmatch(attr):
        raise ValueError(f"{ref!r} names no attribute after ':'; {example}")
    if is_file_reference(ref):
        path = Path(where).expanduser().resolve()
        if path.suffix != ".py" or not path.is_file():
            raise ValueError(f"{ref!r}: no Python file {str(path)!r}; {example}")
        return f"{path}:{attr}"
    if not DOTTED.fullmatch(where):
        raise ValueError(f"{ref!r} is not a reference; {example}")
    return ref


def top_package(ref: str) -> str | None:
    """The top-level package a module reference imports (None for a file reference)."""
    return None if is_file_reference(ref) else split(ref)[0].split(".")[0]


def _file_module(path: Path):
    """Load a file as a module of its own (unique name: two projects' `nets.py` never clash)."""
    name = f"gpuflow_user_{re.sub(r'[^A-Za-z0-9_]', '_', path.stem)}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _where_raised(e: BaseException) -> str:
    if isinstance(e, SyntaxError):  # its message names the file and line already
        return ""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if "importlib" not in f.filename and f.filename != __file__]
    return f" (at {frames[-1].filename}, line {frames[-1].lineno})" if frames else ""


def _import(ref: str, code_root: str | None, what: str):
    """The module a reference names, imported (a file reference: loaded from its file)."""
    where, _ = split(ref)
    try:
        if is_file_reference(ref):  # the file `normalize` and the door name: '~' expanded, links followed
            return _file_module(Path(where).expanduser().resolve())
        if code_root and code_root not in sys.path:
            sys.path.insert(0, code_root)
        return importlib.import_module(where)
    except Exception as e:
        missing = isinstance(e, ModuleNotFoundError)
        if missing and e.name and (where == e.name or where.startswith(e.name + ".")):
            raise CodeReferenceError(
                f"{what} {ref!r}: no module {e.name!r} in {code_root or 'the Python path'}; run gpuflow "
                "from your project's folder (the one holding the package), or check the name") from None
        fix = "; install the missing package or fix the import" if missing else ""
        raise CodeReferenceError(f"{what} {ref!r}: importing {where!r} failed: {describe_error(e)}{fix}") from None


def _no_attribute(ref: str, what: str, owner, part: str) -> CodeReferenceError:
    names = [n for n in dir(owner) if not n.startswith("_")]
    close = difflib.get_close_matches(part, names, n=3)
    hint = f"did you mean {', '.join(close)}?" if close else f"it has: {', '.join(names[:12]) or 'nothing'}"
    return CodeReferenceError(f"{what} {ref!r}: {split(ref)[0]!r} has no attribute {part!r}; {hint}")


def resolve(ref: str, code_root: str | None, what: str = "reference"):
    """Import the module of `ref` and return its (dotted) attribute; CodeReferenceError otherwise.

    Trusts `ref`: a served run's references go through `resolve_defined` first."""
    target = _import(ref, code_root, what)
    for part in split(ref)[1].split("."):
        if not hasattr(target, part):
            raise _no_attribute(ref, what, target, part)
        target = getattr(target, part)
    return target


def loaded_by(ref: str, code_root: str | None, what: str = "reference") -> dict[str, str]:
    """{module name: where it lives (a package: its folder; a module: its file)} of every module that importing
    `ref`'s module loaded, in load order; call it in a fresh process, which imported nothing of that code before.

    What a registered model ships is what its import actually loaded, not what a reading of its code guesses."""
    before = set(sys.modules)
    resolve(ref, code_root, what)
    found = {}
    for name, module in list(sys.modules.items()):
        if name in before or module is None:
            continue
        where = getattr(module, "__file__", None) or _folder(module)  # a namespace package: a folder, no file
        if isinstance(where, str):
            found[name] = str(Path(where).parent if Path(where).stem == "__init__" else where)
    return found


def _folder(module) -> str | None:
    """A namespace package's first folder; None for anything else (torch puts objects of its own in sys.modules)."""
    try:
        return next(iter(module.__path__), None)
    except (AttributeError, TypeError):
        return None


REFERENCE_FIELDS = ("model", "dataset", "objective")  # the parameters that may name user code


def check_references(params, code_root: str | None = None) -> None:
    """Resolve each reference the parameters name, calling nothing (`code_root`: default, the working folder)."""
    for name in REFERENCE_FIELDS:
        value = getattr(params, name, None)
        if is_reference(value):
            resolve(value, code_root or str(Path.cwd()), name)


def _own_code(obj):
    """The class or Python function behind an attribute; None for anything else (modules, builtins, instances)."""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    return obj if inspect.isclass(obj) or inspect.isfunction(obj) else None


def resolve_defined(ref: str, code_root: str | None, defined_in, what: str = "reference"):
    """Resolve `ref` for a served run, whose caller is not trusted: a class or function *defined* in the allowed
    code (`defined_in(module name) -> bool`; a file reference: its own module), as `Name` or `Class.method`.

    Attributes are read statically (no descriptors, no module `__getattr__`) and nothing is called."""
    module = _import(ref, code_root, what)
    parts = split(ref)[1].split(".")
    form = "name a class or function of the allowed code, or a class's method as Class.method"
    if len(parts) > 2 or any(p.startswith("__") for p in parts):
        raise CodeReferenceError(f"{what} {ref!r}: in a served run, {form}; not a path through other objects")
    if is_file_reference(ref):
        defined_in = module.__name__.__eq__
    owner = module
    for part in parts:
        if owner is not module and not inspect.isclass(owner):
            raise CodeReferenceError(f"{what} {ref!r}: {parts[0]!r} is not a class; in a served run, {form}")
        found = inspect.getattr_static(owner, part, None)
        if found is None:
            raise _no_attribute(ref, what, owner, part)
        code = _own_code(found)
        home = getattr(code, "__module__", None) or ""
        if code is None or not defined_in(home):
            kind = f"{type(found).__name__}" + (f" defined in {home!r}" if code is not None else "")
            raise CodeReferenceError(f"{what} {ref!r}: {part!r} is a {kind}, not a class or function defined "
                                     f"in the allowed code; in a served run, {form}")
        owner = getattr(owner, part)  # the allowed code's own class or function, bound as Python binds it
    return owner


def describe_error(e: BaseException) -> str:
    """`Type: message (at file, line N)` for an error raised by user code."""
    return f"{type(e).__name__}: {e}{_where_raised(e)}"
