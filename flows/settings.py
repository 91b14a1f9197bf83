"""Where gpuflow's servers listen and when it retrains: settings, each overridable by a `GPUFLOW_<NAME>` variable.
Every address defaults to 127.0.0.1: reachable from another machine only when set so, knowingly.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

LOOPBACK = "127.0.0.1"


def check_pattern(pattern: str, allowed: str):
    """A check that `v` is a name of `pattern`, whose refusal says what it takes in words, not the regular
    expression; `allowed` lists the characters beyond letters and digits."""
    regex = re.compile(pattern)

    def check(v: str) -> str:
        if not regex.fullmatch(v):
            raise ValueError(f"not a usable name: use up to 100 letters, digits{allowed}, starting with a letter "
                             "or digit")
        return v
    return check


# names of pools, queues and studies (here, not in fields.py: that imports Prefect, the services' settings do not)
POOL_PATTERN, DOTTED_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_-]{0,99}", r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}"
PoolName = Annotated[str, AfterValidator(check_pattern(POOL_PATTERN, ", '_' or '-'")),
                     Field(json_schema_extra={"pattern": f"^{POOL_PATTERN}$"})]  # the Prefect form checks it too
DottedName = Annotated[str, AfterValidator(check_pattern(DOTTED_PATTERN, ", '.', '_' or '-'")),
                      Field(json_schema_extra={"pattern": f"^{DOTTED_PATTERN}$"})]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPUFLOW_")

    prefect_host: str = Field(LOOPBACK, description="address of the Prefect server (`gpuflow server`); "
                              "the served deployments connect to it")
    prefect_port: int = Field(4200, ge=1, le=65535, description="port of the Prefect server")
    mlflow_host: str = Field(LOOPBACK, description="address of the MLflow UI (`gpuflow ui`)")
    mlflow_port: int = Field(5000, ge=1, le=65535, description="port of the MLflow UI")
    retrain_cron: str = Field("0 2 * * *", description="schedule of the served retrain/nightly deployment")
    timezone: str = Field("UTC", description="time zone of retrain_cron")
    allow_code: str = Field("", description="served deployments: comma-separated top-level packages whose "
                            "code a run may name (--model myproj.nets:Net needs myproj); none by default")
    allow_paths: str = Field("", description="served deployments: comma-separated folders that file references "
                             "and path parameters (data_root, runs_dir, resume, ...) must lie in; default: the "
                             "folder `gpuflow serve` runs in")
    allow_stores: str = Field("", description="served deployments: comma-separated tracking URIs and sweep "
                              "storages a run may name besides the operator's own store (MLFLOW_TRACKING_URI, "
                              "else mlflow.db in serve's folder); none by default")

    node_key: str = Field("~/.config/gpuflow/node.key", description="placed runs: the pool's node key, a 0600 "
                          "file that `gpuflow node` makes at its first start; every machine of the pool and every "
                          "account that places runs (gpuflow run --nodes N) needs a copy")

    @property
    def allowed_packages(self) -> set[str]:
        return {p.strip() for p in self.allow_code.split(",") if p.strip()}

    @property
    def allowed_folders(self) -> list[Path]:
        folders = [Path(p.strip()).expanduser().resolve() for p in self.allow_paths.split(",") if p.strip()]
        return folders or [Path.cwd().resolve()]

    @property
    def allowed_stores(self) -> list[str]:
        return [u.strip() for u in self.allow_stores.split(",") if u.strip()]

    @property
    def prefect_api_url(self) -> str:
        return f"http://{self.prefect_host}:{self.prefect_port}/api"

    @property
    def mlflow_ui_url(self) -> str:
        return f"http://{self.mlflow_host}:{self.mlflow_port}"


class NodeService(BaseModel):
    """`gpuflow node`: this machine as one node of the pool, until stopped."""

    pool: PoolName = Field("gpuflow-nodes", description="the Prefect work pool of the machines (a run's node_pool)")
    name: DottedName | None = Field(None, description="this machine's queue in the pool (default: its host name)")


def server_command(s: Settings) -> list[str]:
    return [sys.executable, "-m", "prefect", "server", "start", "--host", s.prefect_host, "--port", str(s.prefect_port)]


def mlflow_server_environment() -> dict[str, str]:
    """The environment for an MLflow server gpuflow starts: this one, its job system off unless set there."""
    # a job system for GenAI features gpuflow never uses, whose polling takes CPU (bench/RESULTS.md)
    return {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **os.environ}


def ui_command(s: Settings) -> list[str]:
    return [sys.executable, "-m", "mlflow", "ui", "--host", s.mlflow_host, "--port", str(s.mlflow_port)]


def ui_environment(tracking_uri: str) -> dict[str, str]:
    """`mlflow ui`'s environment: the store through MLflow's own variables, not arguments (`ps` shows those to every
    account, and a URI may hold a password)."""
    return dict(mlflow_server_environment(), MLFLOW_BACKEND_STORE_URI=tracking_uri,
                MLFLOW_REGISTRY_STORE_URI=tracking_uri)
