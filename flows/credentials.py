"""The team stack's one credential, made at its first start and kept in <data>/credentials.env (0600): the
variables Prefect's and MLflow's clients read (`set -a; . credentials.env; set +a`); the servers get the same.
"""

from __future__ import annotations

import base64
import os
import secrets
from dataclasses import astuple, dataclass
from pathlib import Path

from gpuflow.training.errors import UserError

FILE = "credentials.env"
USERNAME = "gpuflow"
KEYS = ("PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")


@dataclass(frozen=True)
class Credentials:
    prefect_auth_string: str  # user:password, as Prefect's basic auth compares it
    mlflow_username: str
    mlflow_password: str

    def client_env(self) -> dict[str, str]:
        """The variables Prefect's and MLflow's clients read."""
        return dict(zip(KEYS, astuple(self)))

    def prefect_header(self) -> str:
        return "Basic " + base64.b64encode(self.prefect_auth_string.encode()).decode()

    def mlflow_header(self) -> str:
        return "Basic " + base64.b64encode(f"{self.mlflow_username}:{self.mlflow_password}".encode()).decode()


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path`, readable by this account alone, whatever the umask or the file's old mode."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)
        f.write(text)


def load_credentials(path: Path) -> Credentials:
    lines = (line.strip() for line in path.read_text().splitlines())
    values = dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))
    missing = [k for k in KEYS if not values.get(k)]
    if missing:
        raise UserError(f"{path} lacks {', '.join(missing)}: put back the file the stack made at its first start "
                        f"(its lines: {', '.join(KEYS)})")
    return Credentials(*(values[k] for k in KEYS))


def stack_credentials(data: Path) -> tuple[Credentials, bool]:
    """The stack's credentials, and whether they were made just now (then, and only then, shown)."""
    path = data / FILE
    if path.exists():
        path.chmod(0o600)
        return load_credentials(path), False
    password = secrets.token_urlsafe(24)  # URL-safe: sourced by a shell unquoted, sent in basic auth as is
    made = Credentials(f"{USERNAME}:{password}", USERNAME, password)
    body = "".join(f"{k}={v}\n" for k, v in made.client_env().items())
    write_private(path, "# gpuflow stack: the servers' credentials; load with `set -a; . <this file>; set +a`\n" + body)
    return made, True
