"""What proves that a node's job and its rendezvous endpoint come from a holder of the pool's node key (flows/nodes.py).

Whoever holds the Prefect API's credential can create a node flow run, write any Variable and change a flow run's
parameters: the API has no per-object permission. So a node job carries an HMAC of everything it was sent, made with
a key that the pool's machines and the accounts that place runs share as a 0600 file (`gpuflow node` makes it at its
first start); a node runs a job only if the seal holds, the job names its machine, has not expired and never ran
there before; its followers join only an endpoint sealed with that key for that round.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import os
import secrets
import stat
import time
from pathlib import Path

from gpuflow.training.errors import UserError

NODE_QUEUE_ENV = "GPUFLOW_NODE_QUEUE"  # the machine's queue, set by `gpuflow node` for its flow runs


class NodeRunRefused(UserError):
    """A node flow run that no holder of the node key sealed for this machine (forged, altered, replayed)."""


# --- the key ---------------------------------------------------------------------------------


def key_path() -> Path:
    from .settings import Settings

    return Path(Settings().node_key).expanduser()


def make_node_key(pool: str, first: bool) -> tuple[Path, bool]:
    """The node key file, made (0600, 32 random bytes as hex) when missing on the `first` machine of `pool`;
    whether it was made just now. Another machine without it is refused: its key would seal no other's jobs."""
    path = key_path()
    if path.exists():
        read_key(path)  # refused here, at the node's start, if another account could read or change it
        return path, False
    if not first:
        raise UserError(f"no node key at {path}, and pool {pool!r} has machines already: copy the node key that its "
                        "first machine's `gpuflow node` made (~/.config/gpuflow/node.key there) to this path, mode "
                        "0600, or set GPUFLOW_NODE_KEY to where it is")
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:  # another node of this account made it meanwhile
        return path, False
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)
        f.write(secrets.token_hex(32) + "\n")
    return path, True


def read_key(path: Path | None = None) -> bytes:
    """The key, from a regular file of this account that no other account may read or change."""
    path = path or key_path()
    fix = (f"copy the pool's node key (made by `gpuflow node` at its first start, {key_path()} on that machine) "
           f"to {path} with mode 0600, or set GPUFLOW_NODE_KEY to where it is")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise UserError(f"no node key at {path}: a placed run's jobs are sealed with it; {fix}") from None
    except OSError as e:  # ELOOP: a link
        raise UserError(f"node key {path}: {e.strerror}; it must be a plain file: {fix}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise UserError(f"node key {path} must be a file of this account with mode 0600 (it has owner uid "
                            f"{st.st_uid}, mode {st.st_mode & 0o777:o}): run `chmod 600 {path}` as its owner")
        key = f.read().strip()
    if len(key) < 32:
        raise UserError(f"node key {path} holds {len(key)} bytes, fewer than 32: {fix}")
    return key


# --- a node's job --------------------------------------------------------------------------


def _mac(key: bytes, kind: str, value) -> str:
    body = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hmac.new(key, f"gpuflow-{kind}\0{body}".encode(), hashlib.sha256).hexdigest()


def _unsealed(values: dict) -> dict:
    return {**values, "job": {k: v for k, v in values["job"].items() if k != "seal"}}


def seal_values(values: dict, key: bytes) -> dict:
    """`values` (a node flow run's parameters, JSON) with their job sealed: the seal covers every value."""
    values = json.loads(json.dumps(values, default=str))  # as the API stores and gives them back
    values["job"]["seal"] = _mac(key, "node-job", _unsealed(values))
    return values


def check_job(values: dict, queue: str | None, flow_run, flow: str, key: bytes | None = None) -> dict:
    """The job of a node flow run's parameters if a holder of the key sealed them, unaltered, for this machine's
    `queue`, for this node `flow`, and it has not expired; and `flow_run` (a Prefect FlowRun) carries the idempotency
    key its parent gave it, which Prefect keeps unique: a copy of a sealed job in another run is refused. Else
    NodeRunRefused saying why."""
    job = values.get("job") if isinstance(values, dict) else None
    if not isinstance(job, dict) or not isinstance(job.get("seal"), str):
        raise NodeRunRefused("refused a node run without a sealed job: node runs are started by a placed run's "
                             "parent (gpuflow run --nodes N), never by hand or through the API")
    if not hmac.compare_digest(job["seal"], _mac(key or read_key(), "node-job", _unsealed(values))):
        raise NodeRunRefused("refused a node run whose job or parameters no holder of this pool's node key sealed "
                             "(forged, or changed after its parent sent it)")
    if queue is not None and job.get("name") != queue:
        raise NodeRunRefused(f"refused a node run sealed for machine {job.get('name')!r}, not this one ({queue!r})")
    if job.get("flow") != flow:
        raise NodeRunRefused(f"refused a {flow} run of a job sealed for {job.get('flow')!r}")
    if flow_run.idempotency_key != idempotency_key(job):
        raise NodeRunRefused(f"refused a copy of node {job.get('index')} of job {job.get('id')!r}: the run its "
                             "parent started is another flow run")
    if not isinstance(job.get("expires"), (int, float)) or time.time() > job["expires"]:
        raise NodeRunRefused(f"refused a node run of job {job.get('id')!r}: it expired (its parent gives up on a "
                             "node that has not started by then)")
    return job


def idempotency_key(job) -> str:
    """The node flow run's idempotency key, which its parent sets: one flow run per job and node."""
    return f"{job['id']}-{job['index']}" if isinstance(job, dict) else f"{job.id}-{job.index}"


def record_job(job: dict, folder: Path) -> None:
    """Note that this machine ran `job` (its id and index), or refuse it as a replay; expired notes are dropped."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    mark = f"{job['id']} {job['index']}"
    with open(folder / "node-jobs-run", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        notes = [line.split() for line in f.read().splitlines() if line.count(" ") == 2]
        if any(f"{i} {n}" == mark for i, n, _ in notes):
            raise NodeRunRefused(f"refused a second run of node {job['index']} of job {job['id']!r} on this machine "
                                 "(a replay of a run it started before)")
        kept = [f"{i} {n} {e}\n" for i, n, e in notes if float(e) >= time.time()]
        f.seek(0)
        f.truncate()
        f.writelines([*kept, f"{mark} {job['expires']}\n"])


# --- the rendezvous endpoint ---------------------------------------------------------------


def seal_endpoint(round_id: str, endpoint: str, key: bytes) -> str:
    """What node 0 publishes: the endpoint with its seal for this round."""
    return json.dumps({"endpoint": endpoint, "seal": _mac(key, "rdzv", [round_id, endpoint])})


def sealed_endpoint(round_id: str, published, key: bytes) -> str | None:
    """The endpoint in `published` if a holder of the key sealed it for this round, else None."""
    try:
        value = json.loads(published)
        endpoint, seal = value["endpoint"], value["seal"]
    except (TypeError, ValueError, KeyError):
        return None
    if isinstance(endpoint, str) and isinstance(seal, str) and \
            hmac.compare_digest(seal, _mac(key, "rdzv", [round_id, endpoint])):
        return endpoint
    return None
