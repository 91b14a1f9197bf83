"""The code a registered model ships in `code_paths`: what importing its reference actually loads from the model's
folder, found by importing it in a fresh child (the flow stays torch-free), each top-level package or module of the
project copied whole, so that `model:GPT` beside `gptfactory.py` travels with `gptfactory:make`.

Code that cannot travel, a module from outside that folder that no installed distribution provides, is refused in
one line before anything is logged: the registered model could not import it where it loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from gpuflow.training.errors import UserError
from gpuflow.training.reaper import start_supervised

FIND_TIMEOUT_S = 600  # importing the model's code: torch and the user's modules, on a busy machine
# the child's whole program: its one line on stdout is {module name: where it lives}, a refusal its one line on stderr
FIND = """
import json, sys
from gpuflow.training.errors import UserError
from gpuflow.training.refs import loaded_by
try:
    print(json.dumps(loaded_by(sys.argv[1], sys.argv[2] or None, "model")))
except UserError as e:
    sys.exit(f"{e}")
"""


class UnshippableCode(UserError):
    """The model's code imports something the registered model could not carry or install; the message names it."""


def model_code(spec: dict, code_root: str | None, folder: Path) -> tuple[str, list[str]]:
    """(the model's reference inside the registered model, the code to ship in `code_paths`).

    Built-in models ship gpuflow's models file; a module or file reference the project's code its import loads
    (a file reference is then named by its file's stem); a package installed in site-packages ships nothing (a
    requirement of the environment instead). UnshippableCode for code that cannot travel."""
    import importlib.util
    import shutil

    from gpuflow.training.config import BUILTIN_MODELS_MODULE
    from gpuflow.training.refs import is_file_reference

    module, _, attr = spec["reference"].rpartition(":")
    if module == BUILTIN_MODELS_MODULE:  # located, not imported: no torch in the flow
        shipped = folder / "gpuflow_builtin_models.py"
        shutil.copyfile(importlib.util.find_spec(BUILTIN_MODELS_MODULE).origin, shipped)
        return f"{shipped.stem}:{attr}", [str(shipped)]
    if is_file_reference(spec["reference"]):
        own = Path(module).resolve()  # loaded under a name of its own (refs.py), shipped under its stem
        return f"{own.stem}:{attr}", shipped_code(spec["reference"], own.parent, code_root, folder, own)
    root = Path(code_root or Path.cwd()).resolve()
    if code_root and code_root not in sys.path:
        sys.path.insert(0, code_root)
    found = importlib.util.find_spec(module.split(".")[0])  # located, not imported
    if found is not None and in_environment(Path(found.origin or found.submodule_search_locations[0]).resolve()):
        return spec["reference"], []
    return spec["reference"], shipped_code(spec["reference"], root, code_root, folder)


def shipped_code(reference: str, root: Path, code_root: str | None, scratch: Path,
                 own: Path | None = None) -> list[str]:
    """The files and folders to ship for the model of `reference`, whose own code lies under `root` (`own`: the file
    a file reference names)."""
    ship = {own: None} if own else {}  # ordered, each once
    for name, where in loaded_modules(reference, code_root, scratch).items():
        path, top = Path(where).resolve(), name.split(".")[0]
        if path in ship or not path.exists() or in_environment(path):  # no file (a loader's), or the interpreter's
            continue
        if root in path.parents and top_level(name, path).stem == top:  # importable by its name from code/
            ship[top_level(name, path)] = None
        elif not provided(top):
            raise UnshippableCode(
                f"model {reference!r} imports {name!r} from {path}, outside its folder {root} and not an installed "
                "package, so its registered model could not load it; move that module into the folder, or install "
                "it as a package (pip install -e its project)")
    return [str(p) for p in ship]


def loaded_modules(reference: str, code_root: str | None, scratch: Path) -> dict[str, str]:
    """What importing `reference` loads, in a child: no card visible, nothing of this process's imports counted."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # importing never touches a card a run holds
    proc = start_supervised([sys.executable, "-c", FIND, reference, code_root or ""], reap=False, env=env,
                            cwd=scratch, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="backslashreplace")
    try:
        out, err = proc.communicate(timeout=FIND_TIMEOUT_S)
    except BaseException:  # a timeout, Ctrl-C, SIGTERM: the child goes too
        proc.kill()
        proc.wait()
        raise
    if proc.returncode != 0:
        last = (err.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise UnshippableCode(f"model {reference!r} cannot be registered: importing its code failed: {last}")
    return json.loads(out.strip().splitlines()[-1])


def top_level(name: str, path: Path) -> Path:
    """The top-level package folder (or module file) holding module `name`, which lives at `path`."""
    depth = name.count(".")
    return path.parents[depth - 1] if depth else path


def in_environment(path: Path) -> bool:
    """Whether `path` is the interpreter's: the standard library or installed packages."""
    if {"site-packages", "dist-packages"} & set(path.parts):
        return True
    paths = sysconfig.get_paths()
    return any(Path(paths[k]).resolve() in path.parents for k in ("stdlib", "platstdlib", "purelib", "platlib"))


def provided(top: str) -> bool:
    """Whether the standard library or an installed distribution provides the top-level module `top`."""
    from importlib.metadata import packages_distributions

    return top in sys.stdlib_module_names or top in packages_distributions()
