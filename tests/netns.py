"""Two machines on one host, for tests: network namespaces on a bridge, a real Prefect server on
the bridge, a process work pool with one queue and one Prefect worker per namespace.

    from tests.netns import deploy_from_folder, network, two_nodes

    @pytest.fixture(scope="module")
    def cluster(tmp_path_factory):
        with two_nodes(tmp_path_factory.mktemp("nodes")) as c:  # skips unless root with netns
            yield c

    def test_x(cluster, tmp_path):
        with cluster.client_settings():                   # this process talks to its server
            name = deploy_from_folder(folder, "probe.py:report", "probe", cluster.pool)
            run_deployment(name, timeout=0, work_queue_name=cluster.node("node-a").queue)
        cluster.kill_node("node-a")                       # every process in node-a's namespace

    with network() as net:                                # the namespaces alone, no Prefect
        subprocess.run(net.nodes[0].command(["torchrun", f"--local-addr={net.nodes[0].addr}", ...]))

Layout, for a tag `gf<pid hex>x<random>` naming everything of one harness: a bridge `<tag>b` with
10.R.0.1/24 in the root namespace (R picked free; `net.host_addr`), where the server listens;
namespaces `<tag>-node-a` (10.R.0.2) and `<tag>-node-b` (10.R.0.3), each joined by a veth pair,
loopback up. Traffic stays on the bridge and loopback: no route leaves 10.R.0.0/24, and a node
cannot reach the root namespace's 127.0.0.1 (bind servers the nodes use on `host_addr`).

Each node's worker runs `prefect worker start --pool P --work-queue <node> --limit 1 --name <node>`
inside its namespace with PREFECT_API_URL on the bridge, PREFECT_WORKER_QUERY_SECONDS=1, its own
PREFECT_HOME (`<tmp>/<node>/prefect`) and GPUFLOW_LOCK_DIR (`<tmp>/<node>/locks`), and its output in
`<tmp>/<node>/worker.log`; flow runs inherit that environment. Flow runs are started by the
worker in sessions of their own, so a node is stopped by killing every process in its namespace
(`ip netns pids`), not a process group. `cluster.env()` is the environment for a subprocess in the
root namespace (a CLI) that uses the server. gpuflow's own flows deploy with
`to_deployment(..., work_pool_name=cluster.pool, entrypoint_type=EntrypointType.MODULE_PATH,
job_variables={"working_dir": ...}).apply()`: without `working_dir` a run's cwd is a temporary
folder the worker deletes afterwards.

On exit, even after a failure, every process in the namespaces, the workers, the server, the
namespaces and the links are removed; leftovers of a harness whose process died are removed first.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

from tests.servers import BIN, ServerProcess

IP = shutil.which("ip") or "/usr/sbin/ip"
TAG_ENV = "GPUFLOW_NETNS_TAG"  # marks every process a harness starts, to find a dead one's leftovers
TAG_RE = re.compile(r"^gf([0-9a-f]{1,6})x[0-9a-f]{4}")
LOCK = Path("/run/lock/gpuflow-netns.lock")  # one harness at a time picks a subnet
GRACE_S = 10


class NetnsError(RuntimeError):
    pass


def ip(*args: str, ns: str | None = None) -> str:
    cmd = [IP, *(["-n", ns] if ns else []), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise NetnsError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")
    return proc.stdout


# --- processes -------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    """True while pid runs; a zombie (killed, not yet reaped by its parent) counts as gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def terminate(pids_of, grace: float = GRACE_S) -> None:
    """SIGTERM what `pids_of()` lists, SIGKILL what is left after `grace`, until none is alive."""
    _signal(pids_of(), signal.SIGTERM)
    deadline = time.monotonic() + grace
    while (left := [p for p in pids_of() if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    while left := [p for p in pids_of() if _alive(p)]:
        _signal(left, signal.SIGKILL)
        time.sleep(0.1)


def netns_pids(netns: str) -> list[int]:
    try:
        return [int(p) for p in ip("netns", "pids", netns).split()]
    except NetnsError:  # namespace already gone
        return []


def tagged_pids(tag: str) -> list[int]:
    """Processes whose environment carries this harness's tag (its server, workers, their children)."""
    needle = f"{TAG_ENV}={tag}".encode()
    found = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError):
            if needle in env.read_bytes().split(b"\0"):
                found.append(int(env.parent.name))
    return [p for p in found if p != os.getpid()]


# --- network ---------------------------------------------------------------------------------


@dataclass
class Node:
    """One machine: a namespace, its address on the bridge, its work queue and worker."""

    name: str
    netns: str
    addr: str
    veth: str  # the host end, on the bridge
    home: Path | None = None  # PREFECT_HOME, worker.log, card locks of this node
    worker: subprocess.Popen | None = None

    @property
    def queue(self) -> str:
        return self.name

    @property
    def log(self) -> Path:
        return self.home / "worker.log"

    def command(self, argv: list[str]) -> list[str]:
        """argv run inside this node's namespace."""
        return [IP, "netns", "exec", self.netns, *argv]

    def pids(self) -> list[int]:
        return netns_pids(self.netns)


@dataclass
class Network:
    tag: str
    subnet: int  # R of 10.R.0.0/24
    nodes: list[Node] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"{self.tag}b"

    @property
    def host_addr(self) -> str:
        """The root namespace's address on the bridge: bind servers the nodes use here."""
        return f"10.{self.subnet}.0.1"


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (`ip netns add`); run the test as root")
    if not Path(IP).exists():
        pytest.skip(f"iproute2's `ip` not found at {IP}; install iproute2")


def _used_subnets() -> set[int]:
    return {int(m) for m in re.findall(r"inet 10\.(\d+)\.", ip("-4", "-o", "addr"))}


def _new_network() -> Network:
    """A tag and a subnet no other harness or interface here uses (call under LOCK)."""
    free = sorted(set(range(64, 255)) - _used_subnets())
    if not free:
        raise NetnsError("no free 10.R.0.0/24 subnet for the bridge; remove unused 10.x addresses")
    return Network(f"gf{os.getpid():x}x{secrets.token_hex(2)}", random.choice(free))


def _add_bridge(net: Network) -> None:
    ip("link", "add", net.bridge, "type", "bridge")
    ip("addr", "add", f"{net.host_addr}/24", "dev", net.bridge)
    ip("link", "set", net.bridge, "up")


def _add_node(net: Network, name: str) -> Node:
    i = len(net.nodes)
    node = Node(name, f"{net.tag}-{name}", f"10.{net.subnet}.0.{i + 2}", f"{net.tag}h{i}")
    net.nodes.append(node)
    try:
        ip("netns", "add", node.netns)
    except NetnsError as exc:
        pytest.skip(f"cannot create a network namespace here: {exc}")
    peer = f"{net.tag}p{i}"
    ip("link", "add", node.veth, "type", "veth", "peer", "name", peer)
    ip("link", "set", peer, "netns", node.netns)
    ip("link", "set", node.veth, "master", net.bridge)
    ip("link", "set", node.veth, "up")
    ip("addr", "add", f"{node.addr}/24", "dev", peer, ns=node.netns)
    ip("link", "set", peer, "up", ns=node.netns)
    ip("link", "set", "lo", "up", ns=node.netns)
    return node


def _tagged_objects(tag: str) -> tuple[list[str], list[str]]:
    namespaces = [n for n in ip("netns", "list").split() if n.startswith(f"{tag}-")]
    return namespaces, re.findall(rf"^\d+: ({tag}\w+)[@:]", ip("-o", "link"), re.M)


def remove_network(tag: str, timeout: float = 30) -> None:
    """Kill every process of this tag and in its namespaces, then delete namespaces and links."""
    namespaces, _ = _tagged_objects(tag)
    terminate(lambda: [p for ns in namespaces for p in netns_pids(ns)] + tagged_pids(tag))
    deadline = time.monotonic() + timeout
    while any(left := _tagged_objects(tag)):  # the kernel frees a namespace's links asynchronously
        if time.monotonic() > deadline:
            raise NetnsError(f"namespaces or links of {tag} still present after {timeout}s: {left}")
        for ns in left[0]:
            with contextlib.suppress(NetnsError):
                ip("netns", "del", ns)
        for link in left[1]:
            with contextlib.suppress(NetnsError):
                ip("link", "del", link)
        time.sleep(0.1)


def remove_stale() -> None:
    """Remove what harnesses of processes no longer alive left behind (a killed pytest)."""
    names = ip("netns", "list").split() + re.findall(r"^\d+: (\w+)[@:]", ip("-o", "link"), re.M)
    stale = {m.group(0) for n in names if (m := TAG_RE.match(n)) and not _alive(int(m.group(1), 16))}
    for tag in stale:
        remove_network(tag)


@contextlib.contextmanager
def network(names: tuple[str, ...] = ("node-a", "node-b")) -> Iterator[Network]:
    """A bridge and one namespace per name; all removed on exit."""
    require_root()
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        remove_stale()
        net = _new_network()
        try:
            _add_bridge(net)  # under the lock, so the next harness sees this subnet taken
            for name in names:
                _add_node(net, name)
        except BaseException:
            remove_network(net.tag)
            raise
    try:
        yield net
    finally:
        remove_network(net.tag)


# --- Prefect ---------------------------------------------------------------------------------


def _prefect_env(home: Path, tag: str, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1", NO_PROXY="*", **{TAG_ENV: tag}, **extra)
    return env


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def prefect_server_on(net: Network, home: Path) -> tuple[ServerProcess, str]:
    """A `prefect server start` bound to the bridge address, with its own PREFECT_HOME."""
    home.mkdir(parents=True, exist_ok=True)
    port = _free_port(net.host_addr)
    url = f"http://{net.host_addr}:{port}/api"
    cmd = [str(BIN / "prefect"), "server", "start", "--host", net.host_addr, "--port", str(port)]
    return ServerProcess(cmd, url + "/health", _prefect_env(home, net.tag), home / "server.log"), url


def create_pool(api_url: str, pool: str, queues: list[str]) -> None:
    """A process work pool with one queue per node, each running one flow run at a time."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.workers.process import ProcessWorker

    template = ProcessWorker.get_default_base_job_template()
    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process", base_job_template=template))
        for queue in queues:
            client.create_work_queue(name=queue, work_pool_name=pool, concurrency_limit=1)


def start_worker(node: Node, api_url: str, pool: str, tag: str, gpuflow_node: bool = False, **env: str) -> None:
    """The node's Prefect worker, in its namespace and a session of its own; with `gpuflow_node`,
    as `gpuflow node` starts it (with gpuflow's node deployments), serving from the node's folder."""
    node.home.mkdir(parents=True, exist_ok=True)
    argv = ([str(BIN / "gpuflow"), "node", "--pool", pool, "--name", node.name] if gpuflow_node else
            [str(BIN / "prefect"), "worker", "start", "--pool", pool, "--work-queue", node.queue, "--limit", "1",
             "--name", node.name])
    cmd = node.command(argv)
    env = _prefect_env(node.home / "prefect", tag, PREFECT_API_URL=api_url,
                       GPUFLOW_LOCK_DIR=str(node.home / "locks"), **env)
    with open(node.log, "w") as log:
        node.worker = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       cwd=node.home, start_new_session=True)


def wait_polled(api_url: str, pool: str, nodes: list[Node], timeout: float = 120) -> None:
    """Until every node's queue has been polled by its worker (the queue reads READY)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deadline = time.monotonic() + timeout
    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        for node in nodes:
            while client.read_work_queue_by_name(node.queue, work_pool_name=pool).status != "READY":
                if node.worker.poll() is not None:
                    raise RuntimeError(f"worker of {node.name} exited ({node.worker.returncode}); "
                                       f"see {node.log}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"queue {node.queue} not polled within {timeout}s; see {node.log}")
                time.sleep(0.5)


@dataclass
class Cluster:
    """The running harness: its network, server, pool and nodes."""

    net: Network
    server: ServerProcess
    api_url: str
    pool: str
    node_key: Path | None = None  # the pool's node key (GPUFLOW_NODE_KEY), which `gpuflow node` makes

    @property
    def nodes(self) -> list[Node]:
        return self.net.nodes

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def env(self, **extra: str) -> dict:
        """Environment for a subprocess in the root namespace that talks to this server."""
        home = Path(self.server.env["PREFECT_HOME"]).parent / "client"
        key = {"GPUFLOW_NODE_KEY": str(self.node_key)} if self.node_key else {}
        return _prefect_env(home, self.net.tag, PREFECT_API_URL=self.api_url, **key, **extra)

    def client_settings(self):
        """Context in which this process's Prefect client and flows use this server."""
        from prefect.settings import PREFECT_API_URL, temporary_settings

        return temporary_settings({PREFECT_API_URL: self.api_url})

    def kill_node(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Every process in the node's namespace (its worker, flow runs, torchrun, ranks) dies."""
        node = self.node(name)
        if sig == signal.SIGKILL:
            while pids := [p for p in node.pids() if _alive(p)]:
                _signal(pids, sig)
                time.sleep(0.1)
        else:
            terminate(node.pids)
        if node.worker:
            node.worker.wait()

    def stop_nodes(self) -> None:
        for node in self.nodes:
            if node.worker and node.worker.poll() is None:
                terminate(lambda n=node: [n.worker.pid] if n.worker.poll() is None else [])
            terminate(node.pids)


@contextlib.contextmanager
def two_nodes(tmp: Path, names: tuple[str, ...] = ("node-a", "node-b"), query_seconds: float = 1,
              gpuflow_node: bool = False, **worker_env: str) -> Iterator[Cluster]:
    """The whole harness (see the module docstring); `query_seconds` is the workers' polling
    interval (PREFECT_WORKER_QUERY_SECONDS, Prefect's default 10), `gpuflow_node` starts each worker
    with `gpuflow node` (flows/serve.py), `worker_env` extra variables."""
    with network(names) as net:
        server, url = prefect_server_on(net, tmp / "server")
        with server:
            cluster = Cluster(net, server, url, f"gpuflow-nodes-{net.tag}", node_key=tmp / "node-key" / "node.key")
            try:
                create_pool(url, cluster.pool, [n.queue for n in net.nodes])
                for node in net.nodes:
                    node.home = tmp / node.name
                    start_worker(node, url, cluster.pool, net.tag, gpuflow_node,
                                 PREFECT_WORKER_QUERY_SECONDS=str(query_seconds),
                                 GPUFLOW_NODE_KEY=str(cluster.node_key), **worker_env)
                wait_polled(url, cluster.pool, net.nodes)
                yield cluster
            finally:
                cluster.stop_nodes()


def deploy_from_folder(folder: Path, entrypoint: str, name: str, pool: str, **kwargs) -> str:
    """Deploy `entrypoint` ("file.py:flow_fn", relative to folder) to the pool: workers run it from
    folder on disk, no image, no push. Returns "<flow name>/<name>" for run_deployment."""
    from prefect import flow

    loaded = flow.from_source(source=str(folder), entrypoint=entrypoint)
    kwargs.setdefault("ignore_warnings", True)  # else a panel suggesting .serve() for process pools
    loaded.deploy(name=name, work_pool_name=pool, build=False, push=False, print_next_steps=False,
                  **kwargs)
    return f"{loaded.name}/{name}"
