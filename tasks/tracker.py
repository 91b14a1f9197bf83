"""The flow's tracker: a helper process that does the flow's MLflow work on its behalf.

    python -P -m tasks.tracker        (started by Tracker below; speaks JSON lines)

Why a process: importing MLflow and building its SQL store takes ~1.8 s of CPU, and the
registration step needs torch and mlflow.pytorch (~2 s more). In the flow's own process all
of that ran serially before and after the launch, on one core, while the other idled. The
tracker is started when the flow starts (by `gpuflow run` even before Prefect is imported),
so MLflow is loaded beside Prefect's start-up, the probe and the data step; the registration
imports run at low priority during the launch; and rank 0's metrics are logged from here
(`follow`), so nothing beside the ranks imports MLflow.

The run is still the flow's: the flow decides when it starts and how it ends, and only the
flow's tracker creates or ends it (ARCHITECTURE.md, contracts). Nothing is lost if either
side dies: if the flow process goes away (killed, crashed) the tracker sees its input close
and ends a still-open run as KILLED; if the tracker dies, the flow ends the run itself
(`end_run_here`).

Protocol: one JSON object per line on stdin, {"id": n, "op": name, "args": {...}}; one reply
line per request, {"id": n, "ok": value} or {"id": n, "error": "Type: message"}. Operations:
`start` (store, run, params, tags, dataset, environment artifacts), `follow` (relay rank 0's
metrics file to the run), `log_results` (artifacts and the registered model), `log_metrics`,
`end` (status; logs the relay's last lines first). Nothing is read from the store before
the first `start`, so a flow that fails before its MLflow step leaves no trace in it.
Imports only the standard library, MLflow, and (for registration) torch and training/.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

CALL_TIMEOUT_S = 600.0  # registration of a large model over a remote store can take a while
CLOSE_TIMEOUT_S = 30.0


class TrackerError(RuntimeError):
    """The operation failed in the tracker; the message is the original error."""


class TrackerGone(RuntimeError):
    """The tracker process is not there to answer (exited, killed, or silent too long)."""


# --- the client, in the flow's process -------------------------------------------------


class Tracker:
    """A handle on one tracker process (the tracking URI comes with `start`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._replies: queue.Queue[str | None] = queue.Queue()
        self._next_id = 0
        # its own session: Ctrl-C in a terminal goes to the flow, which then ends the run
        # through this process (KILLED), instead of killing both at once
        self._proc: subprocess.Popen | None = subprocess.Popen(
            [sys.executable, "-P", "-m", "tasks.tracker"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, bufsize=1, start_new_session=True)
        threading.Thread(target=self._read, args=(self._proc.stdout,), name="gpuflow-tracker-replies",
                         daemon=True).start()

    def _read(self, replies) -> None:  # its own handle: close() and kill() clear self._proc
        for line in replies:
            self._replies.put(line)
        self._replies.put(None)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def call(self, op: str, timeout: float = CALL_TIMEOUT_S, **args):
        """Run `op` in the tracker and return its result; raises TrackerError or TrackerGone."""
        with self._lock:
            proc = self._proc
            if proc is None:
                raise TrackerGone(f"the MLflow tracker is closed (asked for {op})")
            self._next_id += 1
            try:
                proc.stdin.write(json.dumps({"id": self._next_id, "op": op, "args": args}, default=str) + "\n")
                proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError) as e:
                raise TrackerGone(f"the MLflow tracker exited (code {proc.poll()}) before {op}: {e}") from e
            deadline = time.monotonic() + timeout
            while True:  # an earlier call cut short (Ctrl-C) may have left its answer queued
                try:
                    line = self._replies.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    self.kill()
                    raise TrackerGone(f"the MLflow tracker did not answer {op} within {timeout:.0f} s "
                                      "and was stopped") from None
                if line is None:
                    self._replies.put(None)  # every later call sees the exit too
                    raise TrackerGone(f"the MLflow tracker exited (code {proc.wait()}) during {op}; "
                                      "its error is in the output above")
                reply = json.loads(line)
                if reply.get("id") == self._next_id:
                    break
            if "error" in reply:
                raise TrackerError(reply["error"])
            return reply["ok"]

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """End the tracker (idempotent). A run it still holds open is ended as KILLED."""
        from training.tracking import close_child

        proc, self._proc = self._proc, None
        if proc is not None:
            close_child(proc, timeout)

    def kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()


_spare: list[Tracker] = []


def prestart() -> None:
    """Start a tracker now, for the flow to take later (`acquire`).

    `gpuflow run` calls this before it imports Prefect. An unused one exits when this process
    does (its input closes), having touched no store.
    """
    if not _spare:
        _spare.append(Tracker())


def acquire() -> Tracker:
    """The tracker started early, if there is a live one, else a new one."""
    t = _spare.pop() if _spare else None
    if t is not None and t.alive():
        return t
    if t is not None:
        t.close()
    return Tracker()


def end_run_here(uri: str, run_id: str, exc: BaseException | None) -> str:
    """End the run from the flow's own process: for when the tracker is gone."""
    import mlflow

    from .mlrun import end_run

    mlflow.set_tracking_uri(uri)
    return end_run(run_id, exc)


# --- the server, in the tracker process -------------------------------------------------


class Relay(threading.Thread):
    """Logs the epochs rank 0 appends to its metrics file (training/tracking.py) to the run.

    Complete lines only, each one synchronous log_batch; polls every `interval` seconds, and
    reads the file to its end once more when stopped, so nothing written before is left out.
    """

    def __init__(self, run_id: str, path: str, interval: float = 0.5):
        super().__init__(name="gpuflow-metrics-relay", daemon=True)
        self.run_id, self.path, self.interval = run_id, path, interval
        self.offset = os.path.getsize(path) if os.path.exists(path) else 0  # only this run's lines
        self.logged = 0
        self._halt = threading.Event()

    def run(self) -> None:
        from mlflow.tracking import MlflowClient

        client = MlflowClient()
        while True:
            stopping = self._halt.wait(self.interval)
            self._pump(client)
            if stopping:
                return

    def _pump(self, client) -> None:
        from training.metrics_logger import log_line

        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        complete = data[:data.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.splitlines():
            try:
                log_line(client, self.run_id, line)
                self.logged += 1
            except Exception as e:  # noqa: BLE001 - one bad line must not lose the others
                print(f"gpuflow tracker: could not log metrics line {line[:200]!r}: "
                      f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)

    def finish(self) -> int:
        """Stop after logging everything in the file now; returns the lines logged."""
        self._halt.set()
        self.join()
        return self.logged


class Session:
    """The tracker's state: the run it started and the imports that registration needs."""

    def __init__(self):
        self.run_id: str | None = None
        self.ended = False
        self.warm: threading.Thread | None = None
        self.relay: Relay | None = None

    def start(self, uri: str, experiment: str, run_name: str, params: dict, tags: dict,
              dataset: dict, artifacts: list[dict], system_metrics_interval: float = 2.0) -> dict:
        import mlflow

        from .mlrun import end_run, log_json, prepare_store, start_run

        if self.run_id:
            raise RuntimeError(f"this tracker already holds run {self.run_id}")
        prepare_store(uri)
        self.run_id = start_run(experiment, run_name, params, tags, dataset, system_metrics_interval)
        try:
            for a in artifacts:
                log_json(self.run_id, a["obj"], a["name"], a.get("folder", "environment"))
        except BaseException as e:
            end_run(self.run_id, e)
            self.ended = True
            raise
        self.warm = threading.Thread(target=prewarm, name="gpuflow-prewarm", daemon=True)
        self.warm.start()
        return {"run_id": self.run_id, "experiment_id": mlflow.active_run().info.experiment_id}

    def follow(self, run_id: str, path: str) -> None:
        """Relay rank 0's metrics file to the run until the run's results are logged."""
        self.drain()
        self.relay = Relay(run_id, path)
        self.relay.start()

    def drain(self) -> int:
        relay, self.relay = self.relay, None
        return relay.finish() if relay is not None else 0

    def log_results(self, **kw) -> str:
        from .mlrun import log_results

        self.drain()  # the workers have exited: their last epochs are in the file
        if self.warm is not None:
            self.warm.join()
        return log_results(**kw)

    def log_metrics(self, run_id: str, metrics: dict[str, float]) -> None:
        import mlflow

        mlflow.log_metrics(metrics, run_id=run_id, synchronous=True)

    def end(self, run_id: str, status: str, error: str | None = None) -> str:
        from .mlrun import finish_run

        self.drain()  # a failed run keeps the epochs it finished
        out = finish_run(run_id, status, error)
        if run_id == self.run_id:
            self.ended = True
        return out

    def abandon(self) -> None:
        """The flow went away: end its run, if it left one open."""
        if self.run_id and not self.ended:
            self.end(self.run_id, "KILLED", "the flow process ended without ending this run "
                     "(killed or crashed); its tracker marked it KILLED")


def prewarm() -> None:
    """Imports the registration needs (torch, mlflow.pytorch, matplotlib), while the flow trains.

    At low priority: where cores are short the training processes come first, and this work
    fills the moments they wait (rendezvous, all-reduce); what is left runs after them.
    """
    from .mlrun import import_mlflow_pytorch

    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # this thread only
    except (AttributeError, OSError):
        pass

    import_mlflow_pytorch()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401

    import training.checkpoint  # noqa: F401
    import training.models  # noqa: F401
    try:  # log_model checks pip requirements against a map of every installed package (~0.5 s)
        from mlflow.utils.requirements_utils import _init_packages_to_modules_map

        _init_packages_to_modules_map()
    except Exception:  # a private helper: if it moved, log_model builds the map itself
        pass


def serve(requests, reply) -> None:
    session = Session()
    failed_import = None
    try:  # load MLflow now, before the first request, beside the flow's own start-up
        import mlflow  # noqa: F401
        import mlflow.data.code_dataset_source  # noqa: F401
        import mlflow.data.meta_dataset  # noqa: F401
        import mlflow.store.model_registry.sqlalchemy_store  # noqa: F401
        import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
    except Exception as e:  # reported to the first request, which the flow turns into an error
        failed_import = e
    ops = {"start": session.start, "follow": session.follow, "log_results": session.log_results,
           "log_metrics": session.log_metrics, "end": session.end}
    try:
        for line in requests:
            req = None
            try:
                req = json.loads(line)
                if failed_import is not None:
                    raise failed_import
                if req["op"] not in ops:
                    raise ValueError(f"unknown tracker operation {req['op']!r}; one of {sorted(ops)}")
                out = {"ok": ops[req["op"]](**req.get("args", {}))}
            except BaseException as e:  # noqa: BLE001 - every failure goes back to the flow
                out = {"error": f"{type(e).__name__}: {e}"[:8000]}
            reply(json.dumps({"id": req.get("id") if isinstance(req, dict) else None, **out}, default=str))
    finally:
        session.abandon()


def main() -> int:
    # Replies go to the original stdout; anything a library prints goes to stderr instead.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(text: str) -> None:
        out.write(text + "\n")
        out.flush()

    try:
        serve(sys.stdin, reply)
    except BaseException as e:  # noqa: BLE001
        print(f"gpuflow tracker: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    # Every write above was synchronous; skip the interpreter's teardown of MLflow and torch.
    sys.stderr.flush()
    os._exit(code)
