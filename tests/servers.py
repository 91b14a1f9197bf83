"""Real servers for tests and benchmarks: started on a free 127.0.0.1 port, always stopped."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from gpuflow.flows.settings import mlflow_server_environment

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A child server; `with` waits for its health URL and stops it (group kill) on exit."""

    def __init__(self, cmd: list[str], health: str, env: dict | None = None, log: Path | None = None,
                 cwd: Path | None = None):
        self.cmd, self.health, self.env, self.cwd = cmd, health, env, cwd
        self.log = open(log, "w") if log else subprocess.DEVNULL
        self.proc: subprocess.Popen | None = None

    def __enter__(self):
        self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=self.cwd, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self.startup_s = self.wait()
        except BaseException:
            self.stop()
            raise
        return self

    def wait(self, timeout: float = 180) -> float:
        start = time.perf_counter()
        while time.perf_counter() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.cmd[:4]} exited with {self.proc.returncode} before it was healthy")
            try:
                with urllib.request.urlopen(self.health, timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - start
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"{self.health} not healthy within {timeout}s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        if self.log is not subprocess.DEVNULL:
            self.log.close()

    def __exit__(self, *exc):
        self.stop()


def prefect_server(home: Path, env: dict | None = None) -> tuple[ServerProcess, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    e = dict(env or os.environ, PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    e.pop("PREFECT_API_URL", None)
    cmd = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    return ServerProcess(cmd, url + "/health", e, home / "server.log"), url


def mlflow_server(db: Path, log: Path) -> tuple[ServerProcess, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{db}",
           "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    return ServerProcess(cmd, url + "/health", mlflow_server_environment(), log), url  # as `gpuflow ui`'s
