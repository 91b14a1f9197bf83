"""What a user's script leaves behind, logged to its run: the output folder, the files named by `collect`, the
logs, and the newest state dict as a de-prefixed checkpoint. Only plain files inside the working folder are
logged; a file skipped is named in the run's `gpuflow.skipped` tag and never fails the run.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
from datetime import datetime
from pathlib import Path

from gpuflow.training.contract import CHECKPOINT_SUFFIXES, RunFolder, not_distributed, read_process_group

from .tracking.tracked import TrackedRun

log = logging.getLogger(__name__)

STATE_SUFFIXES = (".pt", ".pth")


def newest_state_file(files: list[Path]) -> Path | None:
    """The newest *.pt/*.pth (a script's last save), skipping temp files of atomic writes."""
    found = [p for p in files if p.suffix in STATE_SUFFIXES and not p.name.startswith(".")]
    return max(found, key=lambda p: p.stat().st_mtime_ns) if found else None


def plain_files(root: Path) -> tuple[list[Path], list[str]]:
    """(files under `root` reached through no symbolic link, the links skipped); a linked `root` yields nothing."""
    if root.is_symlink():
        return [], [f"{root} (a link)"]
    files, skipped = [], []
    for folder, dirs, names in os.walk(root, followlinks=False):
        for name in sorted(dirs + names):
            path = Path(folder) / name
            if path.is_symlink():
                skipped.append(f"{path} (a link)")
            elif name in names and path.is_file() and not name.startswith("."):
                files.append(path)
    return sorted(files), skipped


def written_during(cwd: Path, launched: float, own: Path) -> list[str]:
    """Checkpoint files (by suffix) in `cwd` or a folder right below it written since `launched`, other runs'
    folders (beside `own`, this run's) left out."""
    found = []
    for p in itertools.chain(cwd.glob("*"), cwd.glob("*/*")):
        if p.suffix not in CHECKPOINT_SUFFIXES:  # most entries: no system call for them
            continue
        try:
            real = p.resolve()
            if (p.is_file() and p.stat().st_mtime >= launched
                    and (own.parent not in real.parents or own in real.parents)):
                found.append(str(p.relative_to(cwd)))
        except OSError:  # gone since it was listed
            continue
    return sorted(found)


def collected_files(patterns: list[str], cwd: Path) -> tuple[list[Path], list[str]]:
    """The files the `collect` patterns match whose real paths (links followed) lie in `cwd`."""
    root = cwd.resolve()
    files, skipped = set(), []
    for pattern in patterns:
        try:
            matches = [p for p in cwd.glob(pattern) if p.is_file()]
        except (ValueError, NotImplementedError) as e:  # refused by ScriptParams before launch; kept safe here
            skipped.append(f"{pattern!r} ({e})")
            continue
        for p in matches:
            real = p.resolve()
            if real == root or root not in real.parents:
                skipped.append(f"{p} (its real path {real} is outside {root})")
            else:
                files.add(real)
    return sorted(files), skipped


def gather(run: TrackedRun, patterns: list[str], cwd: Path, launched: float | None = None) -> dict:
    """Log the script's files; returns {"checkpoint", "weights", "model_spec", "outputs", "input_example"}.

    The newest state dict is logged de-prefixed as checkpoints/<name> (if unreadable, unchanged: the
    `gpuflow.checkpoint` tag says why); collected files older than `launched` are named in a tag."""
    from gpuflow.training.metrics import EXAMPLE_STEM, MODEL_FILE  # torch-free

    folder = RunFolder(run.workdir.resolve())
    outputs = folder.outputs
    produced, skipped = plain_files(outputs)
    collected, refused = collected_files(patterns, cwd)
    logs, linked_logs = plain_files(folder.logs)
    skipped += refused + linked_logs
    for root, files, artifact_dir in ((outputs, produced, "outputs"), (folder.logs, logs, "logs")):
        for p in files:
            _log_file(run, p, str(Path(artifact_dir) / p.parent.relative_to(root)), skipped)
    for p in collected:
        _log_file(run, p, "collected", skipped)
    if skipped:
        log.warning("not logged: %s", "; ".join(skipped)[:2000])
        run.client.set_tag(run.run_id, "gpuflow.skipped", "; ".join(skipped)[:4000])
    source = newest_state_file(produced + collected)
    if launched is not None:
        flag_predating(run, [p for p in collected if p.stat().st_mtime < launched], launched, source, cwd)
    found = {"outputs": [str(p.relative_to(outputs)) for p in produced] + [str(p) for p in collected],
             "model_spec": json.loads((outputs / MODEL_FILE).read_text()) if outputs / MODEL_FILE in produced else None,
             "checkpoint": None, "weights": None,
             "input_example": next((str(p) for p in produced if p.parent == outputs and p.stem == EXAMPLE_STEM
                                    and p.suffix in (".npy", ".npz")), None)}
    if source is None:
        run.client.set_tag(run.run_id, "gpuflow.checkpoint", "none: the script saved no *.pt or *.pth file in "
                           "GPUFLOW_OUTPUT_DIR or the collect patterns")
        return found
    return found | checkpoint_from(run, source, found["model_spec"], cwd)


def flag_predating(run: TrackedRun, old: list[Path], launched: float, checkpoint: Path | None, cwd: Path) -> None:
    """Name the collected files older than the launch, perhaps an earlier run's, in a tag and a warning."""
    if not old:
        return
    names = ", ".join(f"{p.relative_to(cwd.resolve())} (written {_when(p.stat().st_mtime)})" for p in old)
    source = " the run's checkpoint is taken from one of them;" if checkpoint in old else ""
    text = (f"collected files older than this run (launched {_when(launched)}): {names}; logged with the run all "
            f"the same, but not written by it (an earlier run's, which the script may have resumed from);{source} "
            "delete or move them before the run to start afresh")
    log.warning("%s", text[:2000])
    run.client.set_tag(run.run_id, "gpuflow.predates_run", text[:4000])


def _when(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp).isoformat(sep=" ", timespec="seconds")


def flag_not_distributed(run: TrackedRun) -> str | None:
    """Say in a tag and a warning when the script's processes never joined a process group; the message, else None."""
    record = read_process_group(RunFolder(run.workdir).process_group)
    if not record or record["joined"] or record["world_size"] < 2:
        return None
    message = not_distributed(record["script"], record["world_size"])
    log.warning("%s", message)
    run.client.set_tag(run.run_id, "gpuflow.not_distributed", message)
    return message


def _log_file(run: TrackedRun, path: Path, artifact_dir: str, skipped: list[str]) -> None:
    try:
        run.client.log_artifact(run.run_id, str(path), artifact_dir)
    except Exception as e:  # a file that vanished or a store that refused it: name it, keep the run's outcome
        skipped.append(f"{path} ({type(e).__name__}: {e})")


def checkpoint_from(run: TrackedRun, source: Path, spec: dict | None, cwd: Path) -> dict:
    from gpuflow.training.checkpoint import CheckpointError, save_file
    from gpuflow.training.statedict import extract_state_dict

    client, run_id = run.client, run.run_id
    try:
        state, where = extract_state_dict(source)
    except CheckpointError as e:  # kept as it is (a whole pickled model, say): still the run's checkpoint
        kept = RunFolder(run.workdir).script_checkpoint / source.name
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, kept)  # the run's own copy: the script's next run may overwrite its file
        client.log_artifact(run_id, str(kept), "checkpoints")
        client.set_tag(run_id, "gpuflow.checkpoint", f"{source.name} logged unchanged, not de-prefixed: {e}"[:4000])
        return {"checkpoint": str(kept)}
    folder = RunFolder(run.workdir)
    payload = {"model": state, "source": str(source), "found_at": where}
    if spec:  # what `gpuflow infer` rebuilds (training/evaluate.py), as for the registered model
        payload |= {"model_spec": spec, "code_root": str(cwd)}
    checkpoint = save_file(folder.script_checkpoint / source.name, payload)
    weights = save_file(folder.weights, state)
    client.log_artifact(run_id, str(checkpoint), "checkpoints")
    client.set_tag(run_id, "gpuflow.checkpoint", f"{source.name}: state dict at {where}, {len(state)} tensors, "
                   "prefixes stripped; loads with load_state_dict(ck['model'], strict=True)")
    return {"checkpoint": str(checkpoint), "weights": str(weights)}


def log_node_logs(run: TrackedRun, node: str) -> None:
    """On a node of a placed script run without global rank 0: log its logs alone, under nodes/<node>/logs."""
    folder = RunFolder(run.workdir)
    logs, skipped = plain_files(folder.logs)
    for p in logs:
        _log_file(run, p, str(Path("nodes", node, "logs") / p.parent.relative_to(folder.logs)), skipped)
    if skipped:
        log.warning("not logged: %s", "; ".join(skipped)[:2000])
