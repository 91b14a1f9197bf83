"""Shared helpers: run the real worker as `python -m gpuflow.training` or under real `torchrun`."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
EXAMPLE = ROOT / "examples" / "myproj"


def user_project(dest: Path) -> Path:
    """examples/myproj with its package renamed `training` (imports rewritten): a user project
    with a `training/` package of its own, next to gpuflow's `gpuflow.training`."""
    shutil.copytree(EXAMPLE / "myproj", dest / "training")
    for f in (dest / "training").glob("*.py"):
        f.write_text(f.read_text().replace("myproj.", "training."))
    return dest


# torchrun's per-launch folders of the tests that start it themselves: here, not a /tmp/torchelastic_* each
TORCHRUN_LOGS = tempfile.mkdtemp(prefix="gpuflow-test-torchrun-")
atexit.register(shutil.rmtree, TORCHRUN_LOGS, ignore_errors=True)


def child_env(**extra: str) -> dict:
    """This process's environment for a child, without the MLflow run or store a flow run in this process left
    there (mlflow.set_tracking_uri sets MLFLOW_TRACKING_URI): name the store in `extra`."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("MLFLOW_RUN_ID", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    env.update(extra)
    return env


def run_worker(workdir: Path, nproc: int = 1, env: dict | None = None, check: bool = True,
               timeout: float = 240, **cfg) -> subprocess.CompletedProcess:
    """Write cfg to workdir/cfg.json and run the worker; nproc > 1 means torchrun + ddp."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg.setdefault("checkpoint_dir", str(workdir / "ckpt"))
    if nproc > 1:
        cfg.setdefault("strategy", "ddp")
    (workdir / "cfg.json").write_text(json.dumps(cfg))
    args = ["-m", "gpuflow.training", "--config", str(workdir / "cfg.json")]
    if cfg.get("strategy") == "ddp":
        cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", f"--log-dir={TORCHRUN_LOGS}", *args]
    else:
        cmd = [sys.executable, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env or child_env(), capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"worker failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def result(workdir: Path) -> dict:
    return json.loads((workdir / "result.json").read_text())
