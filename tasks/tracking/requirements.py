"""What a registered model needs installed, found without importing its code (the flow stays torch-free): the
loader's, the reference's and the shipped code's distributions pinned to the versions installed here; then, for
code shipped from the project folder, the project's declared dependencies, which replace a pin of the same name.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from contextlib import suppress
from importlib.metadata import packages_distributions, version
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

LOADER = ("torch", "torchvision", "mlflow", "numpy")


def model_requirements(reference: str, code_paths: list[str], code_root: str | None) -> list[str]:
    """pip requirement lines for a model of `reference` whose code is `code_paths`, each distribution once."""
    shipped = {Path(p).stem for p in code_paths}
    modules = (imported_modules(code_paths) | {reference.rpartition(":")[0].split(".")[0]}) - shipped
    found = {canonicalize_name(d): pinned(d) for d in [*LOADER, *distributions(modules)]}
    root = Path(code_root).resolve() if code_root else None
    if root and any(root in Path(p).resolve().parents for p in code_paths):
        found |= declared(root)
    return list(found.values())


def imported_modules(code_paths: list[str]) -> set[str]:
    """Top-level names the Python files of `code_paths` import absolutely, standard library excluded."""
    files = [f for p in map(Path, code_paths) for f in (sorted(p.rglob("*.py")) if p.is_dir() else [p])]
    names = set()
    for f in files:
        try:
            tree = ast.parse(f.read_bytes(), str(f))
        except (SyntaxError, ValueError):  # not importable either: the model's load names it
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"__future__"}


def distributions(modules: set[str]) -> list[str]:
    """The installed distributions providing these top-level modules, in name order."""
    modules = modules - set(LOADER)  # listed already: a lookup scans every installed distribution
    if not modules:
        return []
    provided = packages_distributions()
    return sorted({d for m in modules for d in provided.get(m, [])}, key=str.lower)


def pinned(distribution: str) -> str:
    return f"{distribution}=={version(distribution).split('+')[0]}"


def declared(root: Path) -> dict[str, str]:
    """The dependencies `root` declares, by name: pyproject.toml's [project].dependencies, then requirements.txt."""
    lines = []
    with suppress(OSError, tomllib.TOMLDecodeError, KeyError, TypeError):  # none declared there
        lines += tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    if (root / "requirements.txt").is_file():
        lines += [ln.split(" #")[0].strip() for ln in (root / "requirements.txt").read_text().splitlines()]
    found = {}
    for ln in lines:
        with suppress(InvalidRequirement, TypeError):  # a comment, an option (-r, -e), a non-string in pyproject
            found[canonicalize_name(Requirement(ln).name)] = ln
    return found
