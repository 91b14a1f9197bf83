"""The node key and the seals made with it (flows/nodeauth.py): the pure parts; through real nodes in test_nodes.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from gpuflow.flows.nodeauth import (NodeRunRefused, check_job, idempotency_key, make_node_key, read_key, record_job,
                                    seal_endpoint, seal_values, sealed_endpoint)
from gpuflow.training.errors import UserError

pytestmark = pytest.mark.fast


@pytest.fixture
def key_file(tmp_path, monkeypatch):
    path = tmp_path / "keys" / "node.key"
    monkeypatch.setenv("GPUFLOW_NODE_KEY", str(path))
    return path


def test_only_the_pools_first_machine_makes_the_key_the_others_are_told_to_copy_it(key_file):
    with pytest.raises(UserError, match="pool 'p' has machines already: copy the node key"):
        make_node_key("p", first=False)
    assert not key_file.exists()
    assert make_node_key("p", first=True) == (key_file, True)
    assert key_file.stat().st_mode & 0o777 == 0o600 and len(read_key()) == 64
    assert make_node_key("p", first=False) == (key_file, False)  # a copy there: served


def test_a_key_another_account_could_read_or_a_link_is_refused(key_file, tmp_path):
    make_node_key("p", first=True)
    key_file.chmod(0o644)
    with pytest.raises(UserError, match="mode 0600 .*mode 644"):
        read_key()
    key_file.chmod(0o600)
    (tmp_path / "link.key").symlink_to(key_file)
    with pytest.raises(UserError, match="must be a plain file"):
        read_key(tmp_path / "link.key")


def job(**kw) -> dict:
    return {"id": "j1", "index": 1, "name": "node-b", "run_id": "0" * 32, "flow": "train-node",
            "expires": time.time() + 60, **kw}


def run_of(values: dict):
    return SimpleNamespace(idempotency_key=idempotency_key(values["job"]))


@pytest.mark.parametrize("change, refusal", [
    (lambda v: v.update(epochs=99), "no holder of this pool's node key sealed"),
    (lambda v: v["job"].update(index=0), "no holder of this pool's node key sealed"),
    (lambda v: v["job"].pop("seal"), "without a sealed job"),
])
def test_a_sealed_job_changed_after_sealing_is_refused(change, refusal):
    key = b"k" * 64
    values = seal_values({"job": job(), "epochs": 3}, key)
    assert check_job(values, "node-b", run_of(values), "train-node", key)["index"] == 1
    change(values)
    with pytest.raises(NodeRunRefused, match=refusal):
        check_job(values, "node-b", run_of(values), "train-node", key)


def test_a_sealed_job_is_refused_on_another_machine_flow_run_or_flow_and_once_expired():
    key = b"k" * 64
    values = seal_values({"job": job()}, key)
    with pytest.raises(NodeRunRefused, match="sealed for machine 'node-b', not this one"):
        check_job(values, "node-a", run_of(values), "train-node", key)
    with pytest.raises(NodeRunRefused, match="refused a script-node run of a job sealed for 'train-node'"):
        check_job(values, "node-b", run_of(values), "script-node", key)
    with pytest.raises(NodeRunRefused, match="refused a copy of node 1"):
        check_job(values, "node-b", SimpleNamespace(idempotency_key=None), "train-node", key)
    old = seal_values({"job": job(expires=time.time() - 1)}, key)
    with pytest.raises(NodeRunRefused, match="expired"):
        check_job(old, "node-b", run_of(old), "train-node", key)


def test_a_machine_runs_a_job_once(tmp_path):
    record_job(job(), tmp_path)
    record_job(job(index=0), tmp_path)  # another node of the job: its own
    with pytest.raises(NodeRunRefused, match="second run of node 1 of job 'j1'"):
        record_job(job(), tmp_path)


def test_an_endpoint_counts_only_sealed_for_its_round():
    key = b"k" * 64
    published = seal_endpoint("j1-r1", "10.0.0.2:4000", key)
    assert sealed_endpoint("j1-r1", published, key) == "10.0.0.2:4000"
    assert sealed_endpoint("j1-r2", published, key) is None  # another round's
    assert sealed_endpoint("j1-r1", published, b"x" * 64) is None  # another key's
    assert sealed_endpoint("j1-r1", "127.0.0.1:29999", key) is None  # a caller's, unsealed
    assert sealed_endpoint("j1-r1", None, key) is None
