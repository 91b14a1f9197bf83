import atexit
import contextvars
import faulthandler
import os
import shutil
import sys
import tempfile
import threading

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Card locks of every test in a folder of this session, never the machine's /tmp/gpuflow-locks.
os.environ["GPUFLOW_LOCK_DIR"] = tempfile.mkdtemp(prefix="gpuflow-test-locks-")
atexit.register(shutil.rmtree, os.environ["GPUFLOW_LOCK_DIR"], ignore_errors=True)  # each pytest process's own


# `make test-fast`: the pure parts (parameters, space, assignment, contract, references, naming,
# allowlist rules, URI handling), under a minute. A test of these modules that starts a Prefect API
# is left to `make test`.
FAST_MODULES = {"test_params", "test_space", "test_policy", "test_devices", "test_rules", "test_card_locks",
                "test_layout", "test_small_refusals", "test_docs",
                "test_doc_commands"}


# `make test` runs a module at a time on each of two workers (pytest-xdist, `--dist loadfile
# --no-loadscope-reorder`): most of a test's time is waiting on servers, rendezvous and deadlines, so one
# worker keeps about 0.7 of the 2 cores busy. The longest modules go first, so that none starts last.
LONGEST_FIRST = ["test_nodes", "test_served", "test_stack", "test_scripts", "test_node_failover", "test_sweep",
                 "test_reliability", "test_user_code", "test_netns_harness", "test_scripts_real", "test_user_facing",
                 "test_deploy", "test_lifetime", "test_stop", "test_real_models"]


def _module(item) -> str:
    return item.module.__name__.rpartition(".")[2]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_module(item), len(rank)))  # stable: a module's own order is kept
    for item in items:
        if _module(item) in FAST_MODULES and "prefect_api" not in item.fixturenames:
            item.add_marker(pytest.mark.fast)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing entirely
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


SESSION_TRACKING_URI = os.environ.get("MLFLOW_TRACKING_URI")


@pytest.fixture(autouse=True)
def _tracking_uri_restored():
    """MLflow's set_tracking_uri, which a flow run in this process calls (in a test or a module's fixture), also
    sets MLFLOW_TRACKING_URI in os.environ for subprocesses to inherit: a later module's `gpuflow run` would record
    into that test's store (seen once modules ran on two workers in another order). After each test it is what it
    was when the session began."""
    yield
    if SESSION_TRACKING_URI is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = SESSION_TRACKING_URI


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """One Prefect test server for the whole session (it takes ~15 s to start)."""
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ["GPUFLOW_LOCK_DIR"] = str(tmp_path_factory.mktemp("locks"))
    import prefect.testing.utilities as harness

    with harness.prefect_test_harness(server_startup_timeout=180):
        yield
        harness.run_coro_as_sync = _bounded(harness.run_coro_as_sync)  # what the harness's teardown drains with


DRAIN_S = 60  # how long the session's end waits for Prefect's log and event workers to send what they hold


def _bounded(run_coro_as_sync):
    """prefect_test_harness drains Prefect's log and event workers with no timeout before it stops its server; CI
    once waited there until pytest-timeout failed a test that had passed (stop 63). Here the drain runs on a thread
    of its own for at most DRAIN_S: past that, every thread's stack goes to stderr (what was stuck) and the harness
    stops its server all the same."""

    def bounded(coro):
        context = contextvars.copy_context()  # the harness's settings: its API and database
        drain = threading.Thread(target=context.run, args=(run_coro_as_sync, coro), daemon=True,
                                 name="prefect-harness-drain")
        drain.start()
        drain.join(DRAIN_S)
        if drain.is_alive():
            print(f"conftest: Prefect's log and event workers did not drain in {DRAIN_S} s; every thread's stack:",
                  file=sys.stderr, flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    return bounded


@pytest.fixture
def store(tmp_path):
    """A fresh SQLite MLflow store and runs folder for one test."""
    return {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "runs_dir": str(tmp_path / "runs")}
