"""What ranks send each other is tensors, never pickles: rank 0's broadcasts (a path, None, metrics, a checkpoint's
bytes) and rank 0's gather of every rank's outputs and targets, between two real gloo processes; and what a hostile
rank (one a hostile rendezvous store let in) can make of them: a clear error or a plain value, never its code run."""

from __future__ import annotations

import json
import math
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, child_env
from gpuflow.training.checkpoint import load_file, save_file

# Each rank: a gloo group of two on 127.0.0.1, gpuflow's context for it, and done(...) writing its outcome.
PREAMBLE = """
import json, os, pickle, sys
from datetime import timedelta
import torch
import torch.distributed as dist
from gpuflow.training.distributed import DistContext, broadcast_from_main, gather_to_main, load_on_every_rank

rank, port, out, MARKER = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=float(os.environ.get("TEST_RANK_TIMEOUT_S", 20))))
ctx = DistContext(rank, 2, torch.device("cpu"), "ddp")

def done(**result):
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)

def failed(e):
    done(error=type(e).__name__, message=str(e))

class Evil:
    "Unpickling it runs a shell command: it writes the marker file."
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(tmp_path: Path, rank0: str, rank1: str, cwds: tuple[Path, Path] | None = None,
               timeout_s: float = 20) -> list[dict]:
    """Run `rank0` and `rank1` (bodies after PREAMBLE) as the two ranks of a gloo group whose collectives time out
    after `timeout_s`; each one's done(...)."""
    port, marker = _free_port(), tmp_path / "marker"
    procs = []
    for rank, body in enumerate((rank0, rank1)):
        script = tmp_path / f"rank{rank}.py"
        script.write_text(PREAMBLE + textwrap.dedent(body))
        args = [sys.executable, str(script), str(rank), str(port), str(tmp_path), str(marker)]
        procs.append(subprocess.Popen(args, cwd=cwds[rank] if cwds else ROOT, text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, env=child_env(TEST_RANK_TIMEOUT_S=str(timeout_s))))
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=90)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("the two ranks hung: out of step") from None
    said = [tmp_path / f"rank{r}.json" for r in (0, 1)]
    assert all(f.exists() for f in said), "a rank ended without an outcome:\n" + "\n".join(logs)
    return [json.loads(f.read_text()) for f in said]


def _same(a, b) -> bool:
    """Nested dicts/lists/tuples of tensors and plain values equal in kind, dtype, shape and value."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and (a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)))


# --- what honest ranks get: what the object collectives gave ---------------------------------------------------

VALUES = """["/runs/a b/ckpt/epoch-0002.pt", None, "é ünïcode",
          {"val_r2": 0.8125, "val_auc": 1 / 3, "val_tiny": 5e-324, "val_nan": float("nan"), "val_inf": float("inf")}]"""


def test_every_rank_gets_rank_0s_path_none_and_metrics_as_they_were(tmp_path):
    body = f"""
    values = {VALUES} if rank == 0 else [0, 0, 0, {{}}]
    done(got=[broadcast_from_main(v, ctx) for v in values])  # json.dump writes NaN and Infinity as Python reads them
    """
    expected = eval(VALUES)
    for said in _two_ranks(tmp_path, body, body):
        assert len(said["got"]) == 4 and all(_same(e, g) for e, g in zip(expected, said["got"])), said


GATHER = """
def part(r):
    g = torch.Generator().manual_seed(r)
    n = 5 - r  # uneven: rank 0 holds 5 validation samples, rank 1 holds 4
    outputs = {"logits": torch.randn(n, 3, generator=g), "mask": torch.rand(n, generator=g) > 0.5,
               "half": torch.randn(n, 2, 2, generator=g).to(torch.bfloat16)}
    return (outputs, [torch.randint(0, 3, (n,), generator=g), torch.tensor(float(r)), None])
"""


def _part(r: int):
    namespace = {"torch": torch}
    exec(GATHER, namespace)
    return namespace["part"](r)


def test_rank_0_gathers_every_ranks_uneven_outputs_and_targets_in_their_shapes_and_dtypes(tmp_path):
    body = GATHER + textwrap.dedent("""
        got = gather_to_main(part(rank), ctx)
        if rank == 0:
            torch.save(got, os.path.join(out, "gathered.pt"))
        done(got=None if got is None else len(got))
        """)
    rank0, rank1 = _two_ranks(tmp_path, body, body)
    assert (rank0, rank1) == ({"got": 2}, {"got": None})
    assert _same(load_file(tmp_path / "gathered.pt"), [_part(0), _part(1)])


def test_a_rank_gathering_another_kind_of_value_is_an_error_on_every_rank(tmp_path):
    """Its float64 outputs were unpickled on rank 0 and joined with rank 0's float32 ones; now nothing of it is read
    and no rank is left waiting."""
    body = """
    outputs = torch.zeros(4, 3, dtype=torch.float32 if rank == 0 else torch.float64)
    try:
        gather_to_main((outputs, torch.zeros(4)), ctx)
        done(error=None)
    except Exception as e:
        failed(e)
    """
    for said in _two_ranks(tmp_path, body, body):
        assert said["error"] == "CollectiveError", said
        assert said["message"].startswith("ranks [1] of 2 gather values unlike rank 0's"), said


def _checkpoint(folder: Path) -> dict:
    from gpuflow.training.checkpoint import rng_state

    payload = {"model": {"fc.weight": torch.randn(4, 3), "fc.bias": torch.zeros(4)}, "epoch": 2, "rng": rng_state(),
               "config": {"optimizer": "sgd", "lr": 0.1}, "history": [{"epoch": 1, "val_loss": 0.5}]}
    save_file(folder / "ckpt" / "epoch-0002.pt", payload)
    return payload


LOAD = """
try:
    payload = load_on_every_rank("ckpt/epoch-0002.pt", ctx)  # relative: each rank's own machine's folder
    torch.save(payload, os.path.join(out, f"loaded{rank}.pt"))
    done(error=None)
except Exception as e:
    failed(e)
"""


def _machines(tmp_path: Path) -> tuple[Path, Path]:
    """Two 'machines': rank 0's folder and rank 1's, each its own checkpoint folder."""
    cwds = (tmp_path / "node0", tmp_path / "node1")
    for cwd in cwds:
        cwd.mkdir()
    return cwds


def test_a_rank_without_the_file_loads_rank_0s_checkpoint_from_its_bytes(tmp_path):
    cwds = _machines(tmp_path)
    payload = _checkpoint(cwds[0])
    assert _two_ranks(tmp_path, LOAD, LOAD, cwds) == [{"error": None}, {"error": None}]
    for rank in (0, 1):
        assert _same(load_file(tmp_path / f"loaded{rank}.pt"), load_file(cwds[0] / "ckpt" / "epoch-0002.pt"))
    assert torch.equal(load_file(tmp_path / "loaded1.pt")["model"]["fc.weight"], payload["model"]["fc.weight"])


def test_rank_0s_damaged_or_missing_checkpoint_is_the_same_error_on_every_rank(tmp_path):
    cwds = _machines(tmp_path)
    (cwds[0] / "ckpt").mkdir()
    (cwds[0] / "ckpt" / "epoch-0002.pt").write_bytes(b"PK\x03\x04 cut short")
    damaged = _two_ranks(tmp_path, LOAD, LOAD, cwds)
    assert damaged[0] == damaged[1] and damaged[0]["error"] == "CheckpointError", damaged
    assert "'ckpt/epoch-0002.pt' is corrupt or truncated: the file is incomplete" in damaged[0]["message"]
    (cwds[0] / "ckpt" / "epoch-0002.pt").unlink()
    missing = _two_ranks(tmp_path, LOAD, LOAD, cwds)
    assert missing[0] == missing[1] == {"error": "CheckpointError", "message": "checkpoint 'ckpt/epoch-0002.pt' "
                                        "does not exist; check the resume path"}


# --- what a hostile rank can do: nothing it sends is unpickled ---------------------------------------------------

RAW = """
def send(data):  # rank 0's length-then-bytes broadcast, raw: what broadcast_object_list sends of one object too
    dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=0)
    dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0)

def checkpoint_that_runs_code():
    import io
    f = io.BytesIO()
    torch.save({"model": {}, "epoch": Evil()}, f)
    return f.getvalue()
"""

ATTACKS = {
    # a path to resume from: the object collective's own pickle of an object whose unpickling runs a command
    "path": ("dist.broadcast_object_list([Evil()], src=0)", "broadcast_from_main(None, ctx)"),
    # a checkpoint for a rank without the file: the all_reduce that says a rank lacks it, then the pickle
    "checkpoint": ("dist.all_reduce(torch.ones(1, dtype=torch.float64)); dist.broadcast_object_list([Evil()], src=0)",
                   'load_on_every_rank("ckpt/epoch-0002.pt", ctx)'),
    # as the new receiver expects it: no error, then a torch file whose pickle runs a command
    "checkpoint_bytes": ("dist.all_reduce(torch.ones(1, dtype=torch.float64)); send(b'null'); "
                         "send(checkpoint_that_runs_code())", 'load_on_every_rank("ckpt/epoch-0002.pt", ctx)'),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_hostile_rank_0s_pickle_never_runs_on_the_rank_that_receives_it(tmp_path, attack):
    """A hostile store can hand rank 0's place to an attacker; broadcast_object_list unpickled what it sent on every
    other rank, so its pickle ran a command there (the marker file)."""
    hostile, call = ATTACKS[attack]
    receiver = f"""
    try:
        done(got=repr({call}))
    except Exception as e:
        failed(e)
    """
    cwds = _machines(tmp_path)  # rank 1 has no checkpoint of its own
    attacker = RAW + f"try:\n    {hostile}\nexcept RuntimeError:\n    pass  # rank 1 left\n" + UNTIL_RANK_1_IS_DONE
    _, said = _two_ranks(tmp_path, attacker, receiver, cwds)
    assert not (tmp_path / "marker").exists(), f"the hostile rank's pickle ran on rank 1: {said}"
    error, message = {"path": ("CollectiveError", r"rank 0 sent \d+ bytes that are not JSON \(b'\\x80"),
                      "checkpoint": ("CollectiveError", r"rank 0 sent \d+ bytes that are not JSON \(b'\\x80"),
                      "checkpoint_bytes": ("CheckpointError", r"refusing to load 'ckpt/epoch-0002.pt \(sent by rank "
                                           r"0\)': it contains pickled Python objects")}[attack]
    assert said.get("error") == error and re.match(message, said["message"]), said


# the hostile rank 0 hosts the group's store: it stays until rank 1 has said what became of it
UNTIL_RANK_1_IS_DONE = """
import time
done()
while not os.path.exists(os.path.join(out, "rank1.json")):
    time.sleep(0.1)
"""


HOSTILE_PEERS = {
    # gather_to_main's own protocol, with the pickle for its tensors' bytes
    "tensors": """
        import hashlib
        like_rank_0 = b'{"tuple": [["float32", 2], ["int64", 1]]}'  # the digest of rank 0's structure, as its own
        digest = int.from_bytes(hashlib.blake2b(like_rank_0, digest_size=8).digest(), "big", signed=True)
        dist.all_gather([torch.empty(1, dtype=torch.int64) for _ in range(2)], torch.tensor([digest]))
        evil = pickle.dumps(Evil())
        every = [torch.empty(3, dtype=torch.int64) for _ in range(2)]
        dist.all_gather(every, torch.tensor([-(-len(evil) // 4), 1, 0]))  # outputs (n, 1) float32: the pickle
        longest = max(int(s[0] * s[1] * 4 + s[2] * 8) for s in every)
        dist.gather(torch.frombuffer(bytearray(evil.ljust(longest, b".")), dtype=torch.uint8), None, dst=0)
    """,
    # what gather_object sends: its pickle
    "gather_object": "dist.gather_object(Evil(), None, dst=0)",
}


@pytest.mark.parametrize("peer", list(HOSTILE_PEERS))
def test_a_hostile_peers_pickle_never_runs_on_rank_0(tmp_path, peer):
    """gather_object unpickled every peer's bytes on rank 0, so a peer's pickle ran a command there; now rank 0
    reads a peer's bytes as numbers in its own dtypes, and a peer that sends its pickle is an error."""
    rank0 = """
    try:
        got = gather_to_main((torch.zeros(5, 3), torch.zeros(5, dtype=torch.int64)), ctx)
        done(peer=[[str(t.dtype), list(t.shape)] for t in got[1]])
    except Exception as e:
        failed(e)
    """
    attacker = ("try:\n" + textwrap.indent(textwrap.dedent(HOSTILE_PEERS[peer]), "    ") +
                "\nexcept RuntimeError:\n    pass  # rank 0 left\ndone()\n")
    said, _ = _two_ranks(tmp_path, rank0, attacker, timeout_s=5)
    assert not (tmp_path / "marker").exists(), f"the hostile peer's pickle ran on rank 0: {said}"
    if peer == "tensors":
        floats = -(-len(_evil_pickle(tmp_path / "marker")) // 4)
        assert said == {"peer": [["torch.float32", [floats, 1]], ["torch.int64", [0]]]}
    else:  # its pickle's size where rank 0 expects its structure's digest
        assert said.get("error") == "CollectiveError" and "ranks [1] of 2 gather values unlike" in said["message"]


def _evil_pickle(marker: Path) -> bytes:
    import os
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    return pickle.dumps(Evil())
