"""What a run of a served deployment may name: the operator's allowlist.

Whoever can create a flow run can pass any parameter. A reference imports code, and a path
parameter reads or writes files, so in a deployment run (not a local `gpuflow run`, where
the user runs their own code) only packages the operator allowed (`gpuflow serve
--allow-code myproj`, matched by whole top-level name: `myproj` never admits `myproj_evil`)
and paths inside the allowed folders (`--allow-paths`, default: serve's folder) pass. The
flows check it themselves, since a deployment run never passes through the CLI.
"""

from __future__ import annotations

from pathlib import Path

from prefect.runtime import deployment

from gpuflow.training.errors import UserError
from gpuflow.training.refs import is_file_reference, is_reference, split, top_package

from .settings import Settings

REFERENCES = ("model", "dataset", "objective")
PATHS = ("data_root", "runs_dir", "resume", "checkpoint", "inputs", "output", "script")


class NotAllowed(UserError):
    """A served deployment's run named code or a path the operator did not allow."""


def check_allowed(params, settings: Settings | None = None) -> None:
    """Refuse, in a deployment run, references and paths outside the operator's allowlist."""
    if not deployment.get_id():
        return
    settings = settings or Settings()
    packages, folders = settings.allowed_packages, settings.allowed_folders
    shown = ", ".join(map(str, folders))
    for name in REFERENCES:
        value = getattr(params, name, None)
        if not is_reference(value):
            continue
        if is_file_reference(value):
            _inside(name, value, Path(split(value)[0]), folders, shown)
        elif top_package(value) not in packages:
            raise NotAllowed(f"{name}={value!r}: package {top_package(value)!r} is not allowed in this served "
                             f"deployment (allowed: {', '.join(sorted(packages)) or 'none'}); the operator "
                             f"allows it with `gpuflow serve --allow-code {top_package(value)}`")
    dataset = getattr(params, "dataset", None) or ""
    if dataset.startswith("imagefolder:"):
        _inside("dataset", dataset, Path(dataset.split(":", 1)[1]), folders, shown)
    for name in PATHS:
        value = getattr(params, name, None)
        if value and value not in ("auto", "never"):
            _inside(name, value, Path(value), folders, shown)
    for pattern in getattr(params, "collect", None) or []:  # read from the run's working folder
        _inside("collect", pattern, Path(pattern), folders, shown)


def _inside(name: str, value: str, path: Path, folders: list[Path], shown: str) -> None:
    path = path.expanduser().resolve()
    if not any(path == f or f in path.parents for f in folders):
        raise NotAllowed(f"{name}={value!r} is outside the folders this served deployment may use ({shown}); "
                         "use a path inside them, or the operator adds its folder with "
                         "`gpuflow serve --allow-paths <folder>`")
