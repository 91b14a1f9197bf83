"""Find the model's state dict in a file a user's script saved (perhaps nested in a snapshot dict, with
`module.`/`_orig_mod.` prefixes) and strip the prefixes, so it loads strictly into the bare class."""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import CheckpointError, clean_state_dict, load_file

# keys under which scripts commonly keep the model's weights, looked at first
MODEL_KEYS = ("model", "MODEL_STATE", "model_state_dict", "state_dict", "model_state", "net", "module")


def is_state_dict(obj) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items() if k != "_metadata")


def find_state_dict(obj, where: str = "", depth: int = 3) -> tuple[dict, str] | None:
    """(the state dict, its path in the file like "['MODEL_STATE']"); None when there is none."""
    if is_state_dict(obj):
        return obj, where or "(top level)"
    if not isinstance(obj, dict) or depth == 0:
        return None
    keys = [k for k in MODEL_KEYS if k in obj] + [k for k in obj if k not in MODEL_KEYS]
    for k in keys:
        found = find_state_dict(obj[k], f"{where}[{k!r}]", depth - 1)
        if found:
            return found
    return None


def _sharded(state: dict) -> list[str]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return []
    return [k for k, v in state.items() if isinstance(v, DTensor)]


def extract_state_dict(path: str | Path) -> tuple[dict, str]:
    """(the de-prefixed state dict in `path`, where it was found); CheckpointError when the file holds no
    state dict or a sharded one."""
    payload = load_file(path)
    found = find_state_dict(payload)
    if found is None:
        keys = ", ".join(map(str, list(payload)[:8])) if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(f"{str(path)!r} holds no state dict (a dict of tensors); found: {keys}")
    state, where = found
    if sharded := _sharded(state):
        raise CheckpointError(f"{str(path)!r} holds a sharded (FSDP/DTensor) state dict ({sharded[0]}, ...); "
                              "gather it to full tensors first (torch.distributed.checkpoint's "
                              "get_model_state_dict with full_state_dict=True) and save that")
    return clean_state_dict(state), where
