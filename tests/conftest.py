import os
import tempfile

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Card locks of every test in a folder of this session, never the machine's /tmp/gpuflow-locks.
os.environ["GPUFLOW_LOCK_DIR"] = tempfile.mkdtemp(prefix="gpuflow-test-locks-")


# `make test-fast`: the pure parts (parameters, space, assignment, contract, references, naming,
# allowlist rules, URI handling), under a minute. A test of these modules that starts a Prefect API
# is left to `make test`.
FAST_MODULES = {"test_params", "test_space", "test_policy", "test_devices", "test_rules", "test_card_locks",
                "test_layout", "test_small_refusals", "test_docs",
                "test_doc_commands"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rpartition(".")[2] in FAST_MODULES and "prefect_api" not in item.fixturenames:
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


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """One Prefect test server for the whole session (it takes ~15 s to start)."""
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ["GPUFLOW_LOCK_DIR"] = str(tmp_path_factory.mktemp("locks"))
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture
def store(tmp_path):
    """A fresh SQLite MLflow store and runs folder for one test."""
    return {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "runs_dir": str(tmp_path / "runs")}
