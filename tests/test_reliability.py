"""Reliability of a run: restarts continue the run, one worker per checkpoint folder, checkpoints
load on any device and never run code, divergence stops the run, metrics count real samples."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
import torch
from torch import nn

from gpuflow.flows.retrain import retrain
from gpuflow.flows.train import train_pipeline
from gpuflow.training import TrainConfig
from gpuflow.training.__main__ import run
from gpuflow.training.checkpoint import CheckpointError, load_file, load_model_state, set_rng_state
from gpuflow.training.data import load_data
from gpuflow.training.models import SimpleNN
from tests.helpers import ROOT, child_env, result, run_worker

# 320 synthetic samples: 256 to train (4 global batches of 64), 64 to validate.
TINY = dict(dataset="synthetic", synthetic_size=320, batch_size=64, model="mlp", deterministic=True, seed=11)
FLOW = dict(TINY, gpus="cpu")
# Plain SGD at lr 1e4 on TINY: epoch 1 ends finite (loss ~1e18), epoch 2 overflows to nan.
DIVERGING = dict(optimizer="sgd", lr=1e4)


def _client(store) -> mlflow.MlflowClient:
    mlflow.set_tracking_uri(store["tracking_uri"])
    return mlflow.MlflowClient()


def _steps(client, run_id: str, key: str = "val_loss") -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def _run_dir(store, run_id: str) -> Path:
    return Path(store["runs_dir"]).resolve() / run_id


def _inprocess(workdir: Path, **cfg) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    cfg.setdefault("checkpoint_dir", str(workdir / "ckpt"))
    TrainConfig(**cfg).to_json(workdir / "cfg.json")
    return run(str(workdir / "cfg.json"), None)


def _start_file(tmp_path: Path) -> str:
    """A checkpoint after epoch 1 from another folder: the `resume` file of the runs below."""
    run_worker(tmp_path / "start", epochs=1, **TINY)
    return result(tmp_path / "start")["checkpoint"]


# --- restarts -----------------------------------------------------------------------------

RESTARTS = {
    # a Prefect retry of the launch task: a fresh worker process, same run folder
    "prefect retry": (dict(strategy="single", launch_retries=1, max_restarts=0),
                      "rank=0,epoch=3,step=1,once={tmp}/fired"),
    # torchrun's elastic restart: TORCHELASTIC_RESTART_COUNT=1 (step 2: rank 0 has saved epoch 2)
    "torchrun restart": (dict(strategy="ddp", launch_retries=0, max_restarts=1), "rank=1,epoch=3,restart=0,step=2"),
}


@pytest.mark.parametrize("how", list(RESTARTS))
def test_a_restart_continues_from_the_runs_newest_checkpoint_not_the_resume_file(how, prefect_api, store,
                                                                                  monkeypatch, tmp_path):
    start = _start_file(tmp_path)
    launch, fault = RESTARTS[how]
    monkeypatch.setenv("GPUFLOW_FAULT", fault.format(tmp=tmp_path))
    out = train_pipeline(**FLOW, epochs=3, resume=start, **launch, **store)
    monkeypatch.delenv("GPUFLOW_FAULT")
    own = _run_dir(store, out["run_id"]) / "checkpoints"
    assert out["resumed_from"] == str(own / "epoch-0002.pt")  # not `start` again
    assert out["restarts"] == (1 if how == "torchrun restart" else 0)
    if how == "prefect retry":
        assert (tmp_path / "fired").exists()  # the first attempt really died
    client = _client(store)
    assert client.get_run(out["run_id"]).info.status == "FINISHED"
    # epochs 2 and 3 after the start file, each logged once: no epoch trained twice
    assert _steps(client, out["run_id"]) == [2, 3]
    assert [h["epoch"] for h in out["history"]] == [1, 2, 3]  # epoch 1 from the file
    if how == "prefect retry":  # and the weights are those of an uninterrupted run from the file
        run_worker(tmp_path / "straight", epochs=3, resume=start, **TINY)
        a, b = load_file(out["checkpoint"])["model"], load_file(result(tmp_path / "straight")["checkpoint"])["model"]
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_a_prefect_retry_of_a_resume_never_run_continues_the_run(prefect_api, store, monkeypatch, tmp_path):
    # `never` means: do not start from an older run's checkpoint. The run's own folder starts
    # empty, so on a retry its checkpoints can only be this run's: continue from them.
    monkeypatch.setenv("GPUFLOW_FAULT", f"rank=0,epoch=2,step=1,once={tmp_path / 'fired'}")
    out = train_pipeline(**FLOW, epochs=3, resume="never", strategy="single", launch_retries=1, **store)
    monkeypatch.delenv("GPUFLOW_FAULT")
    assert (tmp_path / "fired").exists()  # the first attempt really died
    assert _steps(_client(store), out["run_id"]) == [1, 2, 3]
    assert out["resumed_from"] == str(_run_dir(store, out["run_id"]) / "checkpoints" / "epoch-0001.pt")


def test_a_relative_resume_path_means_relative_to_where_the_flow_was_started(prefect_api, store, monkeypatch,
                                                                             tmp_path):
    user = tmp_path / "user"
    run_worker(user / "start", epochs=1, **TINY)
    monkeypatch.chdir(user)  # the workers run in the run's own folder, not here
    out = train_pipeline(**FLOW, epochs=2, strategy="single", resume="start/ckpt/epoch-0001.pt",
                         data_root="mydata", **store)
    assert out["resumed_from"] == str(user / "start" / "ckpt" / "epoch-0001.pt")
    assert [h["epoch"] for h in out["history"]] == [1, 2]
    config = json.loads((_run_dir(store, out["run_id"]) / "config.json").read_text())
    assert config["resume"] == str(user / "start" / "ckpt" / "epoch-0001.pt")
    assert config["data_root"] == str(user / "mydata")


# --- one worker per checkpoint folder -----------------------------------------------------

HOLDER = """
import sys, time
from gpuflow.training.checkpoint import CheckpointStore
store = CheckpointStore(sys.argv[1])
store.claim()
print("holding", flush=True)
time.sleep(600)
"""


def _started(code: str, *args: str) -> tuple[subprocess.Popen, str]:
    """A helper process and its first line of output (it then waits to be killed)."""
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, env=child_env(),
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    if not line:
        proc.kill()
        proc.wait(30)
        raise AssertionError(f"helper exited with code {proc.returncode} before saying anything")
    return proc, line


def test_a_second_worker_on_a_checkpoint_dir_in_use_is_refused_until_the_holder_dies(tmp_path):
    ckpt = tmp_path / "shared"
    holder, said = _started(HOLDER, str(ckpt))
    try:
        assert said == "holding"
        proc = run_worker(tmp_path / "second", check=False, checkpoint_dir=str(ckpt), epochs=1, **TINY)
        assert proc.returncode == 2, proc.stderr
        assert (f"[rank 0] error: checkpoint_dir '{ckpt}' is in use by another worker (pid {holder.pid}); "
                "give each run its own folder") in proc.stderr
        assert "Traceback" not in proc.stderr
        assert sorted(p.name for p in ckpt.iterdir()) == [".lock"]  # nothing written beside the holder
        # DDP too: rank 0 is refused and the job ends promptly, no rank waits for it
        started = time.monotonic()
        ddp = run_worker(tmp_path / "ddp", nproc=2, check=False, checkpoint_dir=str(ckpt), epochs=1,
                         dist_timeout_s=60, **TINY)
        assert ddp.returncode != 0 and f"in use by another worker (pid {holder.pid})" in ddp.stdout + ddp.stderr
        assert time.monotonic() - started < 50
        assert sorted(p.name for p in ckpt.iterdir()) == [".lock"]
    finally:
        holder.send_signal(signal.SIGKILL)  # killed, not shut down: the kernel drops the lock
        holder.wait(30)
    run_worker(tmp_path / "third", checkpoint_dir=str(ckpt), epochs=1, **TINY)
    assert result(tmp_path / "third")["epochs_run"] == 1


KILLED_WRITER = """
import sys, time
from pathlib import Path
from gpuflow.training.files import atomic_write

def half_then_hang(tmp):
    tmp.write_bytes(b"half a checkpoint")
    print(tmp, flush=True)
    time.sleep(600)

atomic_write(Path(sys.argv[1]), half_then_hang)
"""


def test_a_worker_removes_temp_files_left_by_a_writer_killed_mid_save(tmp_path):
    run_worker(tmp_path, epochs=1, **TINY)
    ckpt = tmp_path / "ckpt"
    writer, said = _started(KILLED_WRITER, str(ckpt / "epoch-0002.pt"))
    tmp = Path(said)
    writer.send_signal(signal.SIGKILL)  # mid-save: no chance to clean up
    writer.wait(30)
    assert tmp.parent == ckpt and tmp.name.startswith(".epoch-0002.pt.") and tmp.name.endswith(".tmp")
    assert tmp.exists()  # the kill left it behind
    run_worker(tmp_path, epochs=2, **TINY)
    assert result(tmp_path)["resumed_from"] == str(ckpt / "epoch-0001.pt")  # never the temp file
    assert sorted(p.name for p in ckpt.iterdir()) == [".lock", "epoch-0001.pt", "epoch-0002.pt"]


# --- loading checkpoints ------------------------------------------------------------------


def _two_machines(tmp_path: Path, epochs: int) -> list[subprocess.CompletedProcess]:
    """A run started by hand on two "machines" (`--nnodes 2`, a process each, each its own folder and checkpoint
    folder) on this host; node 0's folder gets the result."""
    import socket

    from tests.helpers import BIN, TORCHRUN_LOGS

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for node in (0, 1):
        work = tmp_path / f"node{node}"
        work.mkdir(exist_ok=True)
        TrainConfig(**TINY, epochs=epochs, strategy="ddp", device="cpu",
                    checkpoint_dir=str(work / "ckpt")).to_json(work / "cfg.json")
        procs.append(subprocess.Popen(
            [str(BIN / "torchrun"), "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1",
             "--master-addr=127.0.0.1", f"--master-port={port}", "--max-restarts=0", f"--log-dir={TORCHRUN_LOGS}",
             "-m", "gpuflow.training", "--config", str(work / "cfg.json")], cwd=ROOT, env=child_env(),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True))
    done = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:  # ranks out of step wait in a collective until the group's timeout
            for q in procs:
                os.killpg(q.pid, signal.SIGKILL)
            raise AssertionError("the two machines' ranks hung: out of step") from None
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def test_a_run_started_by_hand_on_two_machines_resumes_every_rank_from_rank_0s_checkpoint(tmp_path):
    """Only global rank 0 writes checkpoints, in its machine's folder; node 1's rank found none in its own and
    started from epoch 0 with fresh weights while rank 0 resumed, so the ranks trained out of step."""
    first = _two_machines(tmp_path, epochs=2)
    assert [p.returncode for p in first] == [0, 0], first[1].stderr[-2000:]
    assert not list((tmp_path / "node1" / "ckpt").glob("epoch-*.pt"))  # rank 1 writes none
    again = _two_machines(tmp_path, epochs=3)
    assert [p.returncode for p in again] == [0, 0], again[0].stderr[-2000:] + again[1].stderr[-2000:]
    res = result(tmp_path / "node0")
    assert res["resumed_from"].endswith("epoch-0002.pt") and [h["epoch"] for h in res["history"]] == [1, 2, 3]
    straight = tmp_path / "straight"
    run_worker(straight, nproc=2, **TINY, epochs=3, device="cpu")
    a, b = load_file(res["checkpoint"])["model"], load_file(result(straight)["checkpoint"])["model"]
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k  # as if never stopped


class TwoCards:
    """torch.cuda's generator calls on two cards, of which the process trains on `current` (set_device)."""

    def __init__(self, current: int):
        self.states, self.current = [torch.tensor([0]), torch.tensor([0])], current

    def draw(self):  # what dropout does to the current card's generator
        self.states[self.current] = self.states[self.current] + 1

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in self.states])
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: setattr(self, "states", list(states)))
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: self.states[self.current].clone())
        monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s: self.states.__setitem__(self.current, s))


def test_every_ddp_rank_resumes_its_own_cards_generator_from_rank_0s_checkpoint(monkeypatch):
    """Ranks are seeded alike and draw alike, each on its own card; only rank 0 writes the file. Rank 1 used to
    restore rank 0's view of card 1 (never drawn from: its initial state), so its dropout replayed."""
    from gpuflow.training.checkpoint import rng_state

    rank0, rank1 = TwoCards(current=0), TwoCards(current=1)
    for _ in range(3):  # three epochs' draws, alike on both ranks
        rank0.draw()
        rank1.draw()
    rank0.install(monkeypatch)
    saved = rng_state()
    resumed = TwoCards(current=1)  # rank 1 of the resumed run
    resumed.install(monkeypatch)
    set_rng_state(saved)
    assert resumed.states[1].item() == rank1.states[1].item() == 3


def test_a_run_on_a_non_cpu_device_resumes_because_checkpoints_load_onto_the_cpu(tmp_path, monkeypatch):
    first = _inprocess(tmp_path, epochs=1, **TINY)
    # What a non-CPU map_location does to the RNG states (meta stands in for cuda here):
    with pytest.raises(Exception, match="meta"):
        set_rng_state(load_file(first["checkpoint"], map_location="meta")["rng"])
    asked = []

    def on_another_device(path, map_location="cpu"):
        asked.append(map_location)
        cpu = isinstance(map_location, str) and map_location == "cpu"
        return load_file(path, map_location="cpu" if cpu else "meta")

    monkeypatch.setattr("gpuflow.training.distributed.load_file", on_another_device)
    second = _inprocess(tmp_path, epochs=2, **TINY)
    assert asked == ["cpu"]
    assert second["resumed_from"] == first["checkpoint"] and [h["epoch"] for h in second["history"]] == [1, 2]


class RunsCode:
    """Unpickling this calls os.system: what a hostile checkpoint carries."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_whose_pickle_would_run_code_is_refused_and_the_code_never_runs(tmp_path):
    marker = tmp_path / "code-ran"
    evil = tmp_path / "evil.pt"
    torch.save({"model": SimpleNN().state_dict(), "epoch": 1, "extra": RunsCode(marker)}, evil)
    with pytest.raises(CheckpointError) as err:
        load_file(evil)
    assert str(err.value).startswith(f"refusing to load '{evil}': it contains pickled Python objects")
    assert "(found posix.system)" in str(err.value) and "corrupt" not in str(err.value)
    # through the worker: one clear line, exit 2
    proc = run_worker(tmp_path / "w", check=False, epochs=1, resume=str(evil), **TINY)
    assert proc.returncode == 2 and "[rank 0] error: refusing to load" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not marker.exists()


# --- divergence ---------------------------------------------------------------------------


def _diverged_epoch(error: str) -> int:
    found = re.search(r"train_loss is nan in epoch (\d+); training diverged", error)
    assert found, error
    return int(found.group(1))


@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_a_diverging_run_fails_naming_the_epoch_and_registers_no_model(strategy, prefect_api, store):
    with pytest.raises(Exception, match=r"training failed: TrainingDiverged: train_loss is nan in epoch \d+; "
                       r"training diverged\. Lower lr .* \(rank \d\)$"):  # the one line alone
        train_pipeline(**FLOW, **DIVERGING, epochs=3, strategy=strategy, **store)
    client = _client(store)
    (r,) = client.search_runs([client.get_experiment_by_name("gpuflow").experiment_id])
    assert r.info.status == "FAILED"
    epoch = _diverged_epoch(r.data.tags["error"])
    assert epoch >= 2  # earlier epochs were finite...
    saved = sorted(p.name for p in (_run_dir(store, r.info.run_id) / "checkpoints").glob("*.pt"))
    assert saved == [f"epoch-{e:04d}.pt" for e in range(1, epoch)]  # ...and the diverged one left no file
    assert _steps(client, r.info.run_id, "train_loss") == list(range(1, epoch))
    assert not client.search_model_versions(f"run_id='{r.info.run_id}'")


def test_every_ddp_rank_stops_on_divergence_with_exit_code_3(tmp_path):
    proc = run_worker(tmp_path, nproc=2, check=False, epochs=3, dist_timeout_s=60, **TINY, **DIVERGING)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    epoch = _diverged_epoch(out)
    for rank in (0, 1):  # the check is on the all-reduced loss: both ranks see it, none hangs
        assert f"[rank {rank}] error: train_loss is nan in epoch {epoch}" in out, out[-3000:]
    assert re.search(r"exitcode\s*:\s*3", out), out[-3000:]
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.pt")) == [f"epoch-{e:04d}.pt" for e in range(1, epoch)]


def test_a_retrain_whose_challenger_diverges_fails_and_leaves_the_champion(prefect_api, tmp_path):
    store = dict(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", runs_dir=str(tmp_path / "runs"))
    first = retrain(**FLOW, epochs=1, strategy="single", **store)
    assert first["promoted"]
    with pytest.raises(Exception, match="training failed: TrainingDiverged: train_loss is nan"):
        retrain(**FLOW, **DIVERGING, epochs=3, strategy="single", **store)
    client = _client(store)
    champion = client.get_model_version_by_alias("gpuflow-model", "champion")
    assert str(champion.version) == first["retrain.challenger_version"] == "1"
    assert [str(v.version) for v in client.search_model_versions("name='gpuflow-model'")] == ["1"]
    runs = client.search_runs([client.get_experiment_by_name("gpuflow").experiment_id], order_by=["start_time"])
    assert [r.info.status for r in runs] == ["FINISHED", "FAILED"]
    _diverged_epoch(runs[1].data.tags["error"])


# --- exact metrics ------------------------------------------------------------------------

# 484 samples -> 97 validation, 387 training: odd, so DistributedSampler pads rank 1 with a
# repeated sample. lr 1e-12 leaves the float32 weights as initialised (a weight within ~1e-8 of 0
# may move by ~1e-14), so the epoch's train_loss must be the initial model's mean loss over the 387
# samples, whatever the world size. Counting the padded repeat moves it by ~5e-4.
EXACT = dict(dataset="synthetic", synthetic_size=484, batch_size=64, model="mlp", optimizer="sgd",
             lr=1e-12, momentum=0.0, epochs=1, seed=5, resume="never")


def test_train_loss_counts_every_training_sample_exactly_once_whatever_the_world_size(tmp_path):
    bundle = load_data(TrainConfig(**EXACT))
    assert len(bundle.train) == 387
    losses, weights = {}, {}
    for world in (1, 2):
        run_worker(tmp_path / str(world), nproc=world, **EXACT)
        res = result(tmp_path / str(world))
        assert res["world_size"] == world
        weights[world] = load_file(res["checkpoint"])["model"]
        model = SimpleNN(num_classes=bundle.num_classes)
        load_model_state(model, weights[world])
        with torch.no_grad():
            per_sample = nn.functional.cross_entropy(model(bundle.train.x), bundle.train.y, reduction="none")
        reference = per_sample.double().mean().item()  # each of the 387 samples once
        losses[world] = res["final_metrics"]["train_loss"]
        assert losses[world] == pytest.approx(reference, rel=1e-6, abs=0), world
    assert losses[1] == pytest.approx(losses[2], rel=1e-6, abs=0)
    for k in weights[1]:  # both still the initial weights (to 1e-12): the reference model is the one trained
        assert torch.allclose(weights[1][k], weights[2][k], rtol=0, atol=1e-12), k
