"""Small refusals and failure lines (issue 33, item 8): each one line, naming the value or the culprit,
and nothing run that should not be: a sweep asking for GPUs on a host without any (flows/trial.py),
the node named when a placed run's machine dies (flows/watch.py), a truncated checkpoint
(training/checkpoint.py)."""

from __future__ import annotations

import datetime
import importlib
import itertools
import logging
import os
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gpuflow.flows.cli import main
from gpuflow.tasks.devices.probe import EnvironmentReport
from gpuflow.tasks.failure import TrainingFailed
from gpuflow.training.checkpoint import CheckpointError, load_file
from gpuflow.training.errors import UserError

# --- a placed run's machines ---------------------------------------------------------------------


@pytest.mark.parametrize("nodes, extra, said", [
    ("1:2", [], "nodes 1:2 goes on with fewer machines after losing one; set max_node_failures"),
    ("3:2", ["--max-node-failures", "1"], "min_nodes=3 is above nodes=2; give MIN:MAX with MIN <= MAX"),
    ("one:2", ["--max-node-failures", "1"], "nodes='one:2' is not N or MIN:MAX; e.g. 2, or 1:2")])
def test_a_bad_node_range_is_refused_in_one_line_naming_it(capsys, nodes, extra, said):
    code = main(["run", "--nodes", nodes, *extra, "--gpus", "cpu"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("gpuflow run: ") and said in last, last


def test_a_node_range_is_min_nodes_and_nodes():
    from gpuflow.flows.params import PipelineParams

    p = PipelineParams(nodes="1:3", max_node_failures=2)
    assert (p.min_nodes, p.nodes) == (1, 3) and PipelineParams(nodes=2).min_nodes is None


# --- a sweep's cards ----------------------------------------------------------------------------


def test_a_sweep_naming_gpus_on_a_host_without_any_is_refused_before_any_trial(prefect_api, tmp_path, capsys,
                                                                              monkeypatch):
    sweep = importlib.import_module("gpuflow.flows.sweep")  # the module (gpuflow.flows.sweep is the flow)

    no_gpu = EnvironmentReport(hostname="cpu-box", cpu_count=2, source="none")
    monkeypatch.setattr(sweep, "probe_environment", lambda: no_gpu)
    (tmp_path / "space.yaml").write_text("lr: {type: float, low: 1.0e-3, high: 0.1, log: true}\n")
    code = main(["sweep", "--space", str(tmp_path / "space.yaml"), "--gpus", "0,1", "--gpus-per-trial", "4",
                 "--trials", "1", "--epochs", "1", "--dataset", "digits", "--model", "mlp",
                 "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "--runs-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert err.strip().splitlines()[-1] == ("gpuflow sweep: gpus=0,1 asks for GPUs but none are usable on cpu-box "
                                            "(present: none, CUDA_VISIBLE_DEVICES=unset); use gpus=cpu")
    assert not (tmp_path / "optuna.db").exists() and not (tmp_path / "runs").exists()  # no trial, no study


# --- a placed run whose machine dies ------------------------------------------------------------


class Cluster:
    """A Prefect client as `watch` sees it: two nodes' flow runs and their machines' queues. A node
    `gone` keeps its run RUNNING, answers no cancellation and its worker polls no more."""

    def __init__(self, ends: dict, gone: str | None = None):
        from prefect.states import Running

        self.ends, self.gone, self.reads = ends, gone, itertools.count()
        self.runs = {m: SimpleNamespace(id=uuid.uuid4(), state=Running(), work_pool_name="pool",
                                        work_queue_name=m) for m in ("node-a", "node-b")}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def read_flow_run(self, run_id):
        m = next(m for m, r in self.runs.items() if r.id == run_id)
        if next(self.reads) >= 2 and m in self.ends and self.runs[m].state.is_running():
            self.runs[m].state = self.ends[m]  # the node's end, seen from the second poll on
        return self.runs[m]

    def read_logs(self, *args, **kwargs):
        return []

    def set_flow_run_state(self, run_id, state, force=False):
        from prefect.states import Cancelled

        m = next(m for m, r in self.runs.items() if r.id == run_id)
        if state.is_final():
            self.runs[m].state = state
        elif m != self.gone:  # its worker stops the node's processes and ends its run
            self.runs[m].state = Cancelled(message="cancelled by its worker")

    def read_work_queue_by_name(self, name, work_pool_name):
        polled = datetime.datetime(2026, 1, 1) if name == self.gone else datetime.datetime.now()
        return SimpleNamespace(last_polled=polled)


def watched(monkeypatch, cluster: Cluster) -> str:
    """The line `watch` fails the run with."""
    return str(failure(monkeypatch, cluster))


def failure(monkeypatch, cluster: Cluster):
    """The NodeFailed `watch` fails the run with."""
    import prefect.client.orchestration

    from gpuflow.flows import watch

    monkeypatch.setattr(watch, "POLL_S", 0.01)
    monkeypatch.setattr(watch, "CANCEL_GRACE_S", 0.5)
    monkeypatch.setattr(watch, "get_run_logger", lambda: logging.getLogger("parent"))
    monkeypatch.setattr(prefect.client.orchestration, "get_client", lambda sync_client: cluster)
    with pytest.raises(watch.NodeFailed) as failed:
        watch.watch(dict(cluster.runs), 60)
    return failed.value


@pytest.mark.parametrize("error, repeats", [
    (UserError("precision='fp16' needs CUDA"), True),  # the node's values, refused
    (TrainingFailed("training failed: ValueError: bad sample (at data.py, line 3; rank 1)", deterministic=True), True),
    # under load, a node's torchrun could not reach the rendezvous store: the machine's bad luck, not the job's
    (TrainingFailed("training failed: exited with code 1; its last line: torch.distributed.elastic.rendezvous.api."
                    "RendezvousConnectionError: The connection to the C10d store has failed."), False)])
def test_a_node_failure_a_spare_would_repeat_takes_no_spare_and_a_transient_one_does(monkeypatch, error, repeats):
    import inspect

    from prefect.states import Failed

    from gpuflow.flows import rendezvous
    from gpuflow.flows.rendezvous import as_a_node

    monkeypatch.setattr(rendezvous, "admit_node_run", lambda values: None)  # the door: tests/test_nodes.py

    def node(**values):
        raise error

    node.__signature__ = inspect.signature(node)
    if repeats:
        end = as_a_node(node)()
    else:
        with pytest.raises(TrainingFailed):
            as_a_node(node)()
        end = Failed(message=f"Flow run encountered an exception: TrainingFailed: {error}")  # Prefect's, on a raise
    lost = failure(monkeypatch, Cluster({"node-a": end}))
    assert lost.node == "node-a" and lost.repeats is repeats, str(lost)
    assert str(error).splitlines()[0] in str(lost)


def test_a_node_killed_mid_run_is_the_one_named_not_the_peer_that_lost_it(monkeypatch):
    from prefect.states import Failed

    lost_peer = Failed(message="training failed: RuntimeError: [gloo] Connection closed by peer")
    line = watched(monkeypatch, Cluster({"node-a": lost_peer}, gone="node-b"))
    assert line.startswith("node node-b failed: its machine stopped answering"), line
    assert line.endswith("(other nodes: node-a failed)"), line


def test_of_two_failed_nodes_the_first_to_fail_is_named(monkeypatch):
    from prefect.states import Failed

    first = Failed(message="training failed: ValueError: bad sample (at data.py, line 3; rank 1)")
    then = Failed(message="training failed: RuntimeError: [gloo] Connection closed by peer",
                  timestamp=first.timestamp + datetime.timedelta(seconds=2))
    line = watched(monkeypatch, Cluster({"node-a": then, "node-b": first}))
    assert line == ("node node-b failed: training failed: ValueError: bad sample (at data.py, line 3; rank 1) "
                    "(other nodes: node-a failed)"), line


def test_a_node_failing_alone_is_named_and_its_live_peer_is_cancelled(monkeypatch):
    from prefect.states import Failed

    cluster = Cluster({"node-a": Failed(message="training failed: ValueError: bad sample")})
    line = watched(monkeypatch, cluster)
    assert line == "node node-a failed: training failed: ValueError: bad sample (other nodes: node-b running)"
    assert cluster.runs["node-b"].state.is_cancelled()


def test_a_node_still_preparing_when_its_peer_gave_up_at_the_rendezvous_is_the_one_named(monkeypatch):
    """Node 0 held up (its host's device slot, a download) past the rendezvous timeout: node 1, which waited for
    it and ended first, was blamed and replaced while the slow machine was placed again."""
    from prefect.states import Failed

    gave_up = Failed(message="NodeFailed: node 0 published no rendezvous endpoint within 300 s")
    cluster = Cluster({"node-b": gave_up})
    lost = failure(monkeypatch, cluster)
    assert lost.node == "node-a", str(lost)
    assert str(lost).startswith("node node-a failed: it never joined the rendezvous: node node-b gave up waiting"), \
        str(lost)

# --- a truncated checkpoint ---------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path) -> Path:
    path = tmp_path / "epoch-0003.pt"
    torch.save({"model": {"w": torch.randn(64, 64)}, "epoch": 3}, path)
    return path


def test_a_truncated_checkpoint_says_it_was_cut_short_its_size_and_what_to_do(saved):
    saved.write_bytes(saved.read_bytes()[:5000])
    with pytest.raises(CheckpointError) as refused:
        load_file(saved)
    message = str(refused.value)
    assert message.startswith(f"checkpoint {str(saved)!r} is corrupt or truncated: the file is incomplete: its 5000 "
                              "bytes stop before the end a whole torch file has (cut short"), message
    assert message.endswith("use an earlier checkpoint (--resume <file>), start afresh (--resume never), or pick "
                            "another file"), message


def test_an_empty_checkpoint_says_it_is_empty(saved):
    saved.write_bytes(b"")
    with pytest.raises(CheckpointError) as refused:
        load_file(saved)
    assert f"{str(saved)!r} is corrupt or truncated: the file is empty (0 bytes); use an earlier" in str(refused.value)


# --- a sweep's cards follow a run's rule ----------------------------------------------------------


def _gpu_host(busy: set[int], free_mb: dict[int, int] | None = None) -> EnvironmentReport:
    from gpuflow.tasks.devices.probe import GpuInfo

    gpus = [GpuInfo(index=i, uuid=f"GPU-sweep-{i}", pci_bus_id=f"0000:0{i}:00.0", name="H100",
                    memory_total_mb=80000, memory_free_mb=(free_mb or {}).get(i, 80000),
                    processes=1 if i in busy else 0) for i in range(4)]
    return EnvironmentReport(hostname="gpu-box", cpu_count=16, source="nvml", gpus=gpus)


def _slots(host: EnvironmentReport, tmp_path: Path, **params):
    from gpuflow.flows.params import SweepParams
    from gpuflow.flows.trial import Slots

    (tmp_path / "space.yaml").write_text("lr: {type: float, low: 1.0e-3, high: 0.1, log: true}\n")
    p = SweepParams(space=str(tmp_path / "space.yaml"), tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                    **params)
    return Slots(p, host, probe=lambda: host)


def test_a_sweep_skips_busy_cards_as_a_run_does(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFLOW_LOCK_DIR", str(tmp_path / "locks"))
    host = _gpu_host(busy={0, 2})
    slots = _slots(host, tmp_path, parallel="1")
    taken = [slots.take(), slots.take(), slots.take()]
    assert [s.cards for s in taken if s] == [(1,), (3,)] and taken[2] is None  # 0 and 2 run other processes
    assert _slots(host, tmp_path, parallel="1", skip_busy=False).take().cards == (0,)
    assert _slots(host, tmp_path, parallel="1", gpus="2,0").take().cards == (2,)  # named cards: the user's choice
    short = _gpu_host(busy=set(), free_mb={0: 100, 1: 100})
    assert _slots(short, tmp_path, parallel="1", min_free_mb=1000).take().cards == (2,)


def test_a_sweep_on_too_few_usable_cards_fails_at_once_as_a_run_does(tmp_path, monkeypatch):
    # A desktop's one card runs Xorg: `gpuflow run` refuses at once; the sweep waited for a free slot for ever.
    from gpuflow.tasks.devices.assign import AssignmentError

    monkeypatch.setenv("GPUFLOW_LOCK_DIR", str(tmp_path / "locks"))
    with pytest.raises(AssignmentError, match=r"needs 2 free GPU\(s\) but only 1 are free \(GPU 0: busy.*"
                                              r"GPU 1: busy.*GPU 2: busy.*set skip_busy=false"):
        _slots(_gpu_host(busy={0, 1, 2}), tmp_path, gpus_per_trial=2)
    with pytest.raises(AssignmentError, match="GPU 0: 100 MiB free < min_free_mb 1000"):
        _slots(_gpu_host(busy={1, 2, 3}, free_mb={0: 100}), tmp_path, min_free_mb=1000)
    assert _slots(_gpu_host(busy={0, 1, 2}), tmp_path, gpus_per_trial=2, skip_busy=False).per_trial == 2


def test_a_sweep_asked_for_a_count_of_gpus_uses_at_most_that_many_at_once(tmp_path, monkeypatch):
    from gpuflow.flows.space import SweepError

    monkeypatch.setenv("GPUFLOW_LOCK_DIR", str(tmp_path / "locks"))
    slots = _slots(_gpu_host(busy=set()), tmp_path, gpus="2")
    assert slots.parallel == 2  # trials at once, a card each: 2 of the host's 4 cards at most
    with pytest.raises(SweepError, match="parallel=3 trials do not fit on 2 GPUs"):
        _slots(_gpu_host(busy=set()), tmp_path, gpus="2", parallel="3")


def test_a_cpu_sweeps_trials_share_all_the_hosts_cores_however_few_run_at_a_time(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFLOW_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))  # the cores the report counts
    host = EnvironmentReport(hostname="cpu-box", cpu_count=16, source="none", gpus=[])
    one = _slots(host, tmp_path, gpus="cpu", parallel="1").take()
    assert (one.cores, one.processes) == (16, 1)  # one trial at a time: every core, not one of sixteen
    three = _slots(host, tmp_path, gpus="cpu", parallel="3", cpu_processes=2)
    assert three.take() is None  # the other sweep's trial holds every core
    one.lock.release()
    taken = [three.take() for _ in range(4)]
    assert taken[3] is None and [t.cores for t in taken[:3]] == [5, 5, 5]  # 3 x 5 of 16: two threads a process
    again = _slots(host, tmp_path, gpus="cpu", parallel="2")
    assert again.take() is None  # its first half holds cores 0-7, taken by the three slots of the other sweep
    for t in taken[:3]:
        t.lock.release()
    assert again.take().cores == 8


def test_a_node_log_line_that_lands_behind_lines_already_relayed_is_still_relayed(prefect_api):
    """A node's lines come from two processes (its worker and its flow run), each in batches: one can land
    with an older timestamp than lines the parent already relayed (CI, 2026-11-26: a node's `launching:` line
    was missing from the parent's log)."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import LogCreate

    from gpuflow.flows import watch

    relayed: list[str] = []
    log = SimpleNamespace(info=lambda fmt, *args: relayed.append(fmt % args))
    t0 = datetime.datetime.now(datetime.timezone.utc)
    with get_client(sync_client=True) as client:
        run = client.create_flow_run(flow(lambda: None, name="late-lines"))

        def land(*lines: tuple[float, str]) -> None:
            client.create_logs([LogCreate(name="node", level=20, message=message, flow_run_id=run.id,
                                          timestamp=t0 + datetime.timedelta(seconds=s)) for s, message in lines])

        seen: dict = {}
        land((0, "from the flow run"), (2, "from the flow run, later"))
        watch.relay_logs(client, {"node-a": run}, seen, log)
        land((1, "from the worker, in between"))
        watch.relay_logs(client, {"node-a": run}, seen, log)
        watch.relay_logs(client, {"node-a": run}, seen, log)  # nothing twice
        land((2 + watch.LATE_S + 1, "a minute on"))
        watch.relay_logs(client, {"node-a": run}, seen, log)
        watch.relay_logs(client, {"node-a": run}, seen, log)
    assert relayed == ["[node-a] from the flow run", "[node-a] from the flow run, later",
                       "[node-a] from the worker, in between", "[node-a] a minute on"]
    assert len(seen) == 1  # what it remembers is the lines a read can still return, not the whole run


# --- a failure beside a failure: the first one is what is said --------------------------------------


def test_a_failed_scripts_error_is_not_replaced_by_a_failure_to_keep_its_files(monkeypatch):
    from contextlib import nullcontext

    from gpuflow.flows import launchers

    warned: list = []
    monkeypatch.setattr(launchers, "get_run_logger", lambda: SimpleNamespace(warning=lambda *a: warned.append(a)))

    def raises(error):
        def f(*args):
            raise error
        return f

    monkeypatch.setattr(launchers, "launch_script", raises(TrainingFailed("rank 0 failed")))
    monkeypatch.setattr(launchers, "collect_outputs", raises(OSError("disk full")))
    run = SimpleNamespace(relaying_metrics=nullcontext)
    script = launchers.Script(SimpleNamespace(script="train.py", collect=[]))
    with pytest.raises(TrainingFailed, match="rank 0 failed"):
        script.launch(SimpleNamespace(plan=None, cards=None), run, None, launchers.Launch(log_params=False))
    assert "disk full" in str(warned)


def test_a_script_trials_metric_watch_goes_on_after_a_failed_read(monkeypatch):
    """One failed read of the store once ended the watch: the trial was then never pruned."""
    import time

    from gpuflow.flows import launchers

    warned: list = []
    monkeypatch.setattr(launchers, "get_run_logger", lambda: SimpleNamespace(warning=lambda *a: warned.append(a)))
    reads = itertools.count()

    def history(run_id, metric):
        if next(reads) == 0:
            raise ConnectionError("the store went away")
        return [SimpleNamespace(step=0, timestamp=1, value=0.5)]

    run = SimpleNamespace(client=SimpleNamespace(get_metric_history=history), run_id="r")
    got: list = []
    with launchers.watching(run, "val_accuracy", lambda k, m: got.append((k, m)), interval=0.05):
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
    assert got == [(0, {"val_accuracy": 0.5})]
    assert len(warned) == 1 and "the store went away" in str(warned)


def test_a_retried_placed_run_starts_new_nodes_not_the_earlier_attempts(monkeypatch):
    from gpuflow.flows import nodes

    run_id = str(uuid.uuid4())
    monkeypatch.setattr(nodes, "flow_run", SimpleNamespace(get_id=lambda: run_id, run_count=1))
    first = nodes.job_id()
    monkeypatch.setattr(nodes, "flow_run", SimpleNamespace(get_id=lambda: run_id, run_count=2))
    again = nodes.job_id()
    assert first == run_id and again != first
    nodes.NodeJob(id=again, index=0, name="a", run_id="0" * 32)  # still a valid job id


def test_a_study_resumed_to_optimize_another_metric_is_refused_naming_both(tmp_path):
    # Only the direction was compared: a val_loss study resumed with --optimize train_loss counted the old trials
    # as done and chose its best among values of two metrics.
    from gpuflow.flows.params import SweepParams
    from gpuflow.flows.space import SweepError
    from gpuflow.flows.study import open_study

    (tmp_path / "space.yaml").write_text("lr: {type: float, low: 1.0e-3, high: 0.1, log: true}\n")
    p = SweepParams(space=str(tmp_path / "space.yaml"), tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                    study="s")
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    assert open_study(p, "val_loss", "minimize", url).study.user_attrs["optimize"] == "val_loss"
    with pytest.raises(SweepError, match="study 's' in .* optimizes val_loss, not train_loss; sweep with "
                                         "--optimize val_loss, or name a new study"):
        open_study(p, "train_loss", "minimize", url)
    assert open_study(p, "val_loss", "minimize", url).study.study_name == "s"  # the same again: resumed


def test_a_trial_cut_off_on_another_host_does_not_count_against_the_budget(tmp_path, monkeypatch):
    # A sweep killed on one machine (or container) and resumed from another: its trial, RUNNING with a stopped
    # heartbeat, was failed by Optuna without being marked cut off, and counted: the sweep ran one trial fewer.
    from gpuflow.flows import study as study_module
    from gpuflow.flows.params import SweepParams
    from gpuflow.tasks.tracking import orphans

    monkeypatch.setattr(study_module, "HEARTBEAT_S", 1)  # stale after 2 s (Optuna's grace: twice the interval)
    (tmp_path / "space.yaml").write_text("lr: {type: float, low: 1.0e-3, high: 0.1, log: true}\n")
    p = SweepParams(space=str(tmp_path / "space.yaml"), tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                    study="s")
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    kept = study_module.open_study(p, "val_accuracy", "maximize", url)
    done = kept.study.ask()
    kept.study.tell(done, 0.5)
    gone = kept.study.ask()
    gone.set_user_attr("owner", {orphans.OWNER_HOST: "another-machine", orphans.OWNER_PID: "1"})
    kept.beat(gone.number)
    time.sleep(3)
    again = study_module.open_study(p, "val_accuracy", "maximize", url)
    assert [t.state.name for t in again.study.trials] == ["COMPLETE", "FAIL"]
    assert study_module.counted(again.study) == 1  # was 2
