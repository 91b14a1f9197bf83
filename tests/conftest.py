import os
import tempfile

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Card locks of every test in a folder of this session, never the machine's /tmp/gpuflow-locks.
os.environ["GPUFLOW_LOCK_DIR"] = tempfile.mkdtemp(prefix="gpuflow-test-locks-")


def pytest_collection_modifyitems(config, items):
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
