"""What a run of a served deployment may name: the operator's allowlist.

Whoever can create a flow run can pass any parameter. A reference imports and calls code, and
a path parameter reads or writes files, so in a deployment run (not a local `gpuflow run`,
where the user runs their own code) only this passes:

- a reference to a class or function *defined* in a package the operator allowed (`gpuflow
  serve --allow-code myproj`, matched by whole top-level name: `myproj` never admits
  `myproj_evil`), named by one name or as `Class.method`: `myproj.nets:Net` passes,
  `myproj.nets:nn.functional.torch.os.system` (a path through what `nets` imported) and
  `myproj.nets:torch` (a module) do not;
- a file reference to a project file inside the allowed folders (`--allow-paths`, default:
  serve's folder), never an installed library's file, naming what that file itself defines;
- paths and `collect` patterns whose real paths (links followed) lie inside those folders;
- a sweep's space file there too, and its study in a SQLite file there (no other database URL).

References are checked as what they resolve to (training/refs.py `resolve_defined`), without
calling anything. The flows check it themselves, first, since a deployment run never passes
through the CLI.
"""

from __future__ import annotations

import site
import sys
import sysconfig
from pathlib import Path

from prefect.runtime import deployment

from gpuflow.training.errors import UserError
from gpuflow.training.refs import (REFERENCE_FIELDS, CodeReferenceError, is_file_reference, is_reference,
                                  resolve_defined, split, top_package)

from .settings import Settings

PATHS = ("data_root", "runs_dir", "resume", "checkpoint", "inputs", "output", "script", "space")


class NotAllowed(UserError):
    """A served deployment's run named code or a path the operator did not allow."""


def check_allowed(params, settings: Settings | None = None) -> None:
    """Refuse, in a deployment run, references and paths outside the operator's allowlist."""
    if not deployment.get_id():
        return
    settings = settings or Settings()
    packages, folders = settings.allowed_packages, settings.allowed_folders
    shown = ", ".join(map(str, folders))
    for name in REFERENCE_FIELDS:
        value = getattr(params, name, None)
        if is_reference(value):
            _check_reference(name, value, packages, folders, shown)
    dataset = getattr(params, "dataset", None) or ""
    if dataset.startswith("imagefolder:"):
        _inside("dataset", dataset, Path(dataset.split(":", 1)[1]), folders, shown)
    for name in PATHS:
        value = getattr(params, name, None)
        if value and value not in ("auto", "never"):
            _inside(name, value, Path(value), folders, shown)
    for pattern in getattr(params, "collect", None) or []:  # read from the run's working folder
        _inside("collect", pattern, Path(pattern), folders, shown)
    storage = getattr(params, "storage", None)  # a sweep's study: a file it creates and writes
    if storage:
        if not storage.startswith("sqlite:///"):
            raise NotAllowed(f"storage={storage[:200]!r}: a served sweep keeps its study in a SQLite file inside "
                             f"the folders it may use ({shown}); leave storage unset (optuna.db beside the "
                             "tracking store) or give sqlite:///<such a folder>/optuna.db")
        _inside("storage", storage, Path(storage[len("sqlite:///"):]), folders, shown)


def _check_reference(name: str, value: str, packages: set[str], folders: list[Path], shown: str) -> None:
    """The reference's module is allowed, and what it names is the allowed code's own class or function."""
    if is_file_reference(value):
        path = _inside(name, value, Path(split(value)[0]), folders, shown)
        if _is_library_file(path):
            raise NotAllowed(f"{name}={value!r} is a file of installed Python code ({path}); a served run's file "
                             "reference names a file of your project")
        defined_in = None  # the file's own module (resolve_defined)
    else:
        top = top_package(value)
        if top not in packages:  # refused before anything is imported
            raise NotAllowed(f"{name}={value!r}: package {top!r} is not allowed in this served deployment "
                             f"(allowed: {', '.join(sorted(packages)) or 'none'}); the operator allows it with "
                             f"`gpuflow serve --allow-code {top}`")
        defined_in = lambda module: module.split(".")[0] in packages  # noqa: E731
    try:
        resolve_defined(value, str(Path.cwd()), defined_in, name)
    except CodeReferenceError as e:
        raise NotAllowed(str(e)) from None


def _is_library_file(path: Path) -> bool:
    """Whether a file is installed Python code (the standard library, a site-packages folder),
    even where it lies in an allowed folder (a project's .venv)."""
    if {"site-packages", "dist-packages"} & set(path.parts):
        return True
    places = {*site.getsitepackages(), site.getusersitepackages()}
    for base in {sys.prefix, sys.base_prefix}:
        paths = sysconfig.get_paths(vars={"base": base, "platbase": base, "installed_base": base,
                                          "installed_platbase": base})
        places |= {paths["stdlib"], paths["platstdlib"], paths["purelib"], paths["platlib"]}
    return any(lib in path.parents for lib in {Path(p).resolve() for p in places if p})


def _inside(name: str, value: str, path: Path, folders: list[Path], shown: str) -> Path:
    """The path's real location (links followed), which must lie in an allowed folder."""
    path = path.expanduser().resolve()
    if not any(path == f or f in path.parents for f in folders):
        raise NotAllowed(f"{name}={value!r} is outside the folders this served deployment may use ({shown}); "
                         "use a path inside them, or the operator adds its folder with "
                         "`gpuflow serve --allow-paths <folder>`")
    return path
