"""The door of a served deployment: what its runs may touch, checked as what each name resolves to (torch-free).

Whoever can create a flow run can pass any parameter, and whoever can write to a store a run reads back controls
what comes back; so a served run (never a local `gpuflow run`) may name, in its parameters and in what it reads
back, only what `gpuflow serve` allowed: code defined in allowed packages or project files in allowed folders,
paths in those folders, the operator's tracking store, a named store or a SQLite file there.
"""

from __future__ import annotations

import json
import os
import site
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError
from .files import only_mine
from .uris import plain_sqlite, same_store, shown, sqlite_file
from .refs import (REFERENCE_FIELDS, CodeReferenceError, is_file_reference, is_reference, resolve_defined, split,
                   top_package)

# the served policy's file (JSON, 0600, the operator's), for the children of a served run; never the policy itself,
# which anything that can set a child's environment could then widen
POLICY_FILE_ENV = "GPUFLOW_POLICY_FILE"
PATH_FIELDS = ("data_root", "runs_dir", "resume", "checkpoint", "inputs", "output", "script", "space")
CONFIG_PATHS = ("data_root", "code_root", "data_cache")  # what a checkpoint's config reads from


class NotAllowed(UserError):
    """A served deployment's run named code, a path or a store the operator did not allow."""


@dataclass(frozen=True)
class Policy:
    """What a served run may name: packages, folders and stores; children get it through POLICY_FILE_ENV."""

    packages: frozenset[str] = frozenset()
    folders: tuple[Path, ...] = ()
    home_store: str = ""  # the operator's tracking store: always allowed
    stores: tuple[str, ...] = ()  # further tracking stores or study storages, by name

    # --- building and passing it on ---------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps({"packages": sorted(self.packages), "folders": list(map(str, self.folders)),
                           "home_store": self.home_store, "stores": list(self.stores)})

    def write_private(self) -> Path:
        """The policy in a new file of this account alone (0600), for POLICY_FILE_ENV; its caller removes it."""
        fd, path = tempfile.mkstemp(prefix="gpuflow-policy-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(self.to_json())
        return Path(path)

    @classmethod
    def from_env(cls) -> "Policy | None":
        """The policy a served run handed its children (POLICY_FILE_ENV), or None (a local run). The file must be a
        regular file of this account that no other may change: anything else is refused, never taken as no policy."""
        if not (path := os.environ.get(POLICY_FILE_ENV)):
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            raise NotAllowed(f"{POLICY_FILE_ENV}={path!r}: {e.strerror}; the operator's `gpuflow serve` or "
                             "`gpuflow node` hands its runs their policy file (restart it)") from None
        with os.fdopen(fd) as f:
            st = os.fstat(f.fileno())
            if not only_mine(st):
                raise NotAllowed(f"{POLICY_FILE_ENV}={path!r} is not a file of this account that only it may "
                                 f"change (owner uid {st.st_uid}, mode {st.st_mode & 0o777:o}); refused")
            d = json.loads(f.read())
        return cls(frozenset(d["packages"]), tuple(Path(f) for f in d["folders"]), d["home_store"], tuple(d["stores"]))

    @property
    def shown(self) -> str:
        return ", ".join(map(str, self.folders))

    # --- a flow's parameters ----------------------------------------------------------------

    def check_params(self, params) -> None:
        """Every reference, path and store a flow's parameters name (a model or a raw dict)."""
        for name in REFERENCE_FIELDS:
            if not isinstance(value := _get(params, name), (str, type(None))):
                raise NotAllowed(f"{name}={value!r}: expected text (a built-in name or a reference)")
            if is_reference(value):
                self.check_reference(name, value, str(Path.cwd()))
        if isinstance(dataset := _get(params, "dataset"), str) and dataset.startswith("imagefolder:"):
            self.check_path("dataset", dataset, dataset.split(":", 1)[1])
        for name in PATH_FIELDS:
            value = _get(params, name)
            if value is None or (name == "resume" and value in ("auto", "never")):
                continue
            path = self.check_path(name, value)
            if name == "script" and is_library_file(path):
                raise NotAllowed(f"script={value!r} is a file of installed Python code ({path}); a served run "
                                 "runs a script of your project")
        if (_get(params, "nnodes") or 1) != 1 or _get(params, "rdzv_endpoint") is not None:
            raise NotAllowed("nnodes/rdzv_endpoint: a served run joins no rendezvous its caller names (its ranks "
                             "would trust that endpoint's store); place it on the pool's machines with nodes=N")
        collect = _get(params, "collect") or []
        for pattern in collect if isinstance(collect, list) else [collect]:  # read from the run's working folder
            self.check_path("collect", pattern)
        if (tracking := _get(params, "tracking_uri")) is not None:
            self.check_store("tracking_uri", tracking)
        if (storage := _get(params, "storage")) is not None:
            self.check_storage(storage, tracking or self.home_store)

    def check_reference(self, name: str, value, code_root: str | None) -> None:
        """Refuse a reference unless it names a class or function defined in the allowed code."""
        value = _text(name, value)
        if is_file_reference(value):
            path = self.check_path(name, value, split(value)[0])
            if is_library_file(path):
                raise NotAllowed(f"{name}={value!r} is a file of installed Python code ({path}); a served run's "
                                 "file reference names a file of your project")
            defined_in = None  # the file's own module (resolve_defined)
        else:
            top = top_package(value)
            if top not in self.packages:  # refused before anything is imported
                raise NotAllowed(f"{name}={value!r}: package {top!r} is not allowed in this served deployment "
                                 f"(allowed: {', '.join(sorted(self.packages)) or 'none'}); the operator allows "
                                 f"it with `gpuflow serve --allow-code {top}`")
            if "__main__" in split(value)[0].split("."):  # a script: importing it runs it
                raise NotAllowed(f"{name}={value!r} names a package's __main__, which runs when imported; name "
                                 "the module that defines it (e.g. myproj.nets:Net)")
            defined_in = lambda module: module.split(".")[0] in self.packages  # noqa: E731
        try:
            resolve_defined(value, code_root, defined_in, name)
        except CodeReferenceError as e:
            raise NotAllowed(str(e)) from None

    def check_path(self, name: str, value, path: str | None = None) -> Path:
        """The path's real location (links followed), which must lie in an allowed folder."""
        real = Path(_text(name, value) if path is None else path).expanduser().resolve()
        if not any(real == f or f in real.parents for f in self.folders):
            raise NotAllowed(f"{name}={value!r} is outside the folders this served deployment may use "
                             f"({self.shown}); use a path inside them, or the operator adds its folder with "
                             "`gpuflow serve --allow-paths <folder>`")
        return real

    def check_store(self, name: str, uri) -> None:
        """A tracking store: the operator's own, one allowed by name, or a SQLite file in the allowed folders
        (a run writes there anyway)."""
        uri = _text(name, uri)
        if same_store(uri, self.home_store) or any(same_store(uri, s) for s in self.stores):
            return
        file = sqlite_file(uri)
        if file is not None and plain_sqlite(uri) and any(file == f or f in file.parents for f in self.folders):
            return
        raise NotAllowed(f"{name}={shown(uri)!r}: a served run records to the operator's tracking store "
                         f"({shown(self.home_store)}) or a SQLite file in the folders it may use ({self.shown}); "
                         f"leave {name} unset, or the operator allows that store with "
                         "`gpuflow serve --allow-stores <uri>`")

    def check_storage(self, storage, tracking_uri: str) -> None:
        """A study's storage: a store the operator named, else a SQLite file in the allowed folders."""
        storage = _text("storage", storage)
        if any(same_store(storage, s) for s in self.stores):
            return
        file = sqlite_file(storage)
        if file is None:
            raise NotAllowed(f"storage={shown(storage)[:200]!r}: a served sweep keeps its study in a "
                             f"SQLite file inside the folders it may use ({self.shown}), or in a database the "
                             "operator allows with `gpuflow serve --allow-stores <url>`; leave storage unset "
                             "(optuna.db beside the tracking store) or give sqlite:///<such a folder>/optuna.db")
        self.check_path("storage", storage, str(file))
        check_not_tracking_store(storage, tracking_uri)

    # --- what a run reads back from a store -------------------------------------------------

    def check_config(self, config: dict, source: str) -> None:
        """The code and folders a checkpoint's config (or a script's model spec) names, before anything is imported."""
        if not isinstance(config, dict):
            raise NotAllowed(f"{source} holds no config a served run can check; it was not written by gpuflow")
        code_root = config.get("code_root")
        for name in CONFIG_PATHS:
            if config.get(name) is not None:
                self.check_path(f"{source}: {name}", config[name])
        for name in (*REFERENCE_FIELDS, "reference"):
            if not isinstance(value := config.get(name), (str, type(None))):
                raise NotAllowed(f"{source}: {name}={value!r} is not a name or reference")
            if is_reference(value):
                self.check_reference(f"{source}: {name}", value, code_root)
        if isinstance(dataset := config.get("dataset"), str) and dataset.startswith("imagefolder:"):
            self.check_path(f"{source}: dataset", dataset, dataset.split(":", 1)[1])


# --- helpers ---------------------------------------------------------------------------------


def _get(params, name: str):
    return params.get(name) if isinstance(params, dict) else getattr(params, name, None)


def _text(name: str, value) -> str:
    if not isinstance(value, str):
        raise NotAllowed(f"{name}={value!r}: expected text (a reference, path or URI)")
    return value


def check_not_tracking_store(storage: str, tracking_uri: str | None) -> None:
    """A study never lives in the tracking store's own file (Optuna's tables would mix with MLflow's)."""
    if tracking_uri and sqlite_file(storage) is not None and same_store(storage, tracking_uri):
        raise UserError(f"storage={storage[:200]!r} is the tracking store's own file ({sqlite_file(storage)}); "
                        "keep the study in a file of its own, e.g. optuna.db beside it (leave storage unset)")


def is_library_file(path: Path) -> bool:
    """Whether a file is installed Python code (stdlib, site-packages), even in an allowed folder (a .venv)."""
    if {"site-packages", "dist-packages"} & set(path.parts):
        return True
    places = {*site.getsitepackages(), site.getusersitepackages()}
    for base in {sys.prefix, sys.base_prefix}:
        paths = sysconfig.get_paths(vars={"base": base, "platbase": base, "installed_base": base,
                                          "installed_platbase": base})
        places |= {paths["stdlib"], paths["platstdlib"], paths["purelib"], paths["platlib"]}
    return any(lib in path.parents for lib in {Path(p).resolve() for p in places if p})
