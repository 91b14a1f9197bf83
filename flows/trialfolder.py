"""A script trial's working folder: the project's inputs linked in, nothing a run writes (#58: an earlier run's
output folder linked into every trial let all of them overwrite one checkpoint, the user's own included).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from gpuflow.training.contract import CHECKPOINT_SUFFIXES
from gpuflow.training.uris import sqlite_file

from .params import SweepParams


def stores(params: SweepParams, study_url: str | None = None) -> list[Path]:
    """What the sweep itself writes, never a trial's to share: its runs folder, the tracking store's file (or
    folder) and the study's file."""
    found = [Path(params.runs_dir)]
    for uri in (params.tracking_uri, study_url):
        if uri and (db := sqlite_file(uri)):
            found.append(db)
        elif uri and "://" not in uri.removeprefix("file://"):  # MLflow's file store: a folder (mlruns)
            found.append(Path(uri.removeprefix("file://")))
    return found


@dataclass
class TrialFolder:
    """What a script trial sees of the project: the project's inputs linked in, and nothing a run writes.

    An input is whatever an earlier run did not write: source, configs, data. A run's outputs are known by kind
    (a checkpoint, a log, a database: OUTPUT_ENDINGS), by the sweep's own stores and runs folder, and by what
    `collect` names. A folder holding none of them is linked whole (a data set is one link, however many files);
    a folder holding one is made afresh in the trial's folder and its entries judged the same way, so an output
    folder of an earlier run (nanoGPT's out-*/ckpt.pt) is the trial's own, empty, and never the project's. A link
    is an input; the script may still write through one, but only into a folder no run has written outputs to."""

    project: Path
    links: list[Path]  # relative to `project`: linked in each trial's folder
    made: list[Path]  # folders holding outputs, made afresh (parents first)
    left_out: list[Path]  # outputs: never in a trial's folder

    @classmethod
    def of(cls, project: Path, collect: list[str], stores: list[Path]) -> "TrialFolder":
        """The plan for `project`, read once: the trials' own writes never reach the project."""
        outputs = {p.resolve() for p in stores} | {p.resolve() for pattern in collect for p in project.glob(pattern)}
        holding = _holding_outputs(project, outputs)
        links, made, left_out = [], [], []
        todo = [project]
        while todo:
            folder = todo.pop(0)
            for entry in sorted(folder.iterdir()):
                rel, real = entry.relative_to(project), entry.resolve()
                if real in outputs or (entry.name.endswith(OUTPUT_ENDINGS) and not real.is_dir()):
                    left_out.append(rel)
                elif real in holding:
                    made.append(rel)
                    todo.append(entry)
                else:
                    links.append(rel)
        return cls(project, links, made, left_out)

    def make(self, work: Path) -> Path:
        """The trial's working folder `work`, made as planned."""
        work.mkdir(parents=True, exist_ok=True)
        for rel in self.made:
            (work / rel).mkdir(exist_ok=True)
        for rel in self.links:
            if not os.path.lexists(work / rel):
                (work / rel).symlink_to(self.project / rel)
        return work

    def describe(self, most: int = 12) -> str:
        """One line for the sweep's log: what the trials' folders link, make afresh and leave out."""
        def names(paths: list[Path]) -> str:
            shown = [f"{p}/" if (self.project / p).is_dir() else str(p) for p in paths[:most]]
            return ", ".join(shown) + (f" and {len(paths) - most} more" if len(paths) > most else "") or "none"

        return (f"each trial runs in its run folder's work/: linked from {self.project}: {names(self.links)}; made "
                f"afresh (an earlier run's outputs in them): {names(self.made)}; left out (what a run writes): "
                f"{names(self.left_out)}")


# what runs write: checkpoints, logs, databases (mlflow.db, optuna.db and their journals)
OUTPUT_ENDINGS = (*CHECKPOINT_SUFFIXES, ".log", ".db", ".sqlite", ".sqlite3", "-wal", "-shm", "-journal")


def _holding_outputs(project: Path, outputs: set[Path]) -> set[Path]:
    """The real paths of the folders under `project` holding an output (a linked folder's content included, each
    folder read once); an output folder (the runs folder) is never read through."""
    holding: set[Path] = set()
    seen: set[Path] = set()

    def mark(path: Path) -> None:  # `path` is under `project` as named: its folders up to the project hold it
        for folder in path.parents:
            holding.add(folder.resolve())
            if folder == project:
                return

    def scan(top: Path) -> bool:
        if (real := top.resolve()) in seen:
            return real in holding
        seen.add(real)
        for folder, dirs, files in os.walk(top):
            here, inside = Path(folder), []
            for d in dirs:
                if (here / d).resolve() in outputs or (here / d).is_symlink() and scan(here / d):
                    mark(here / d)
                elif not (here / d).is_symlink():
                    inside.append(d)
            dirs[:] = inside
            if any(f.endswith(OUTPUT_ENDINGS) or (here / f).resolve() in outputs for f in files):
                mark(here / files[0])
        return real in holding

    scan(project)
    return holding
