"""What a user's script leaves behind, logged to its run: the output folder, the files named
by `collect`, the logs, and the newest state dict as a de-prefixed checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from .tracking import TrackedRun

STATE_SUFFIXES = (".pt", ".pth")


def newest_state_file(files: list[Path]) -> Path | None:
    """The newest *.pt/*.pth (a script's last save), skipping temp files of atomic writes."""
    found = [p for p in files if p.suffix in STATE_SUFFIXES and not p.name.startswith(".")]
    return max(found, key=lambda p: p.stat().st_mtime_ns) if found else None


def declared_model(path: Path) -> dict | None:
    """The model the script declared with gpuflow.training.helper.declare_model, or None."""
    return json.loads(path.read_text()) if path.is_file() else None


def gather(run: TrackedRun, patterns: list[str], cwd: Path) -> dict:
    """Log the script's files; returns {"checkpoint", "weights", "model_spec", "outputs"}.

    The newest state dict is loaded with weights_only=True, found when nested in a snapshot
    dict, stripped of `module.`/`_orig_mod.` and logged as checkpoints/<name> ({"model": ...});
    a file that cannot be read that way is logged unchanged, and the run's
    `gpuflow.checkpoint` tag says why.
    """
    from gpuflow.training.metrics import MODEL_FILE  # torch-free: no torch import when there is nothing to load

    client, run_id, outputs = run.client, run.run_id, run.workdir / "outputs"
    produced = sorted(p for p in outputs.rglob("*") if p.is_file() and not p.name.startswith("."))
    collected = sorted({p.resolve() for pattern in patterns for p in cwd.glob(pattern) if p.is_file()})
    if produced:
        client.log_artifacts(run_id, str(outputs), "outputs")
    for p in collected:
        client.log_artifact(run_id, str(p), "collected")
    if (run.workdir / "logs").is_dir():
        client.log_artifacts(run_id, str(run.workdir / "logs"), "logs")
    found = {"outputs": [str(p.relative_to(outputs)) for p in produced] + [str(p) for p in collected],
             "model_spec": declared_model(outputs / MODEL_FILE), "checkpoint": None, "weights": None}
    source = newest_state_file(produced + collected)
    if source is None:
        client.set_tag(run_id, "gpuflow.checkpoint", "none: the script saved no *.pt or *.pth file in "
                       "GPUFLOW_OUTPUT_DIR or the collect patterns")
        return found
    return found | checkpoint_from(run, source, found["model_spec"], cwd)


def checkpoint_from(run: TrackedRun, source: Path, spec: dict | None, cwd: Path) -> dict:
    from gpuflow.training.checkpoint import CheckpointError, save_file
    from gpuflow.training.statedict import extract_state_dict

    client, run_id = run.client, run.run_id
    try:
        state, where = extract_state_dict(source)
    except CheckpointError as e:
        client.log_artifact(run_id, str(source), "checkpoints")
        client.set_tag(run_id, "gpuflow.checkpoint", f"{source.name} logged unchanged, not de-prefixed: {e}"[:4000])
        return {"checkpoint": None}
    folder = run.workdir / "checkpoint"
    payload = {"model": state, "source": str(source), "found_at": where}
    if spec:  # what `gpuflow infer` rebuilds (training/evaluate.py), as for the registered model
        payload |= {"model_spec": spec, "code_root": str(cwd)}
    checkpoint = save_file(folder / source.name, payload)
    weights = save_file(run.workdir / "weights.pt", state)
    client.log_artifact(run_id, str(checkpoint), "checkpoints")
    client.set_tag(run_id, "gpuflow.checkpoint", f"{source.name}: state dict at {where}, {len(state)} tensors, "
                   "prefixes stripped; loads with load_state_dict(ck['model'], strict=True)")
    return {"checkpoint": str(checkpoint), "weights": str(weights)}
