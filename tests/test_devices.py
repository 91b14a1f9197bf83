"""Probe and device assignment: table-driven from fake hosts, plus real child processes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from gpuflow.flows.params import Devices, PipelineParams
from gpuflow.tasks.devices.assign import AssignmentError, assign_devices_for
from gpuflow.tasks.devices.cards import CardLockError, CardLocks
from gpuflow.tasks.devices.probe import EnvironmentReport, GpuInfo, read_environment
from tests.helpers import ROOT


def host(n: int, busy=(), free=80_000, cvd=None, cc="9.0", cpus=16) -> EnvironmentReport:
    gpus = [GpuInfo(index=i, uuid=f"GPU-{i:04d}", pci_bus_id=f"00000000:{0x10 + i:02X}:00.0",
                    name="NVIDIA H100", compute_capability=cc, memory_total_mb=81_559,
                    memory_free_mb=free - 1000 * i, processes=1 if i in busy else 0)
               for i in range(n)]
    return EnvironmentReport(hostname="fake", cpu_count=cpus, source="nvml", gpus=gpus,
                             cuda_visible_devices=cvd)


FOUR, EIGHT_BUSY0, INHERITED, CPU = host(4), host(8, busy={0}), host(4, cvd="1,2"), host(0, cpus=2)

PLANS = [  # (host, request, batch, precision, expected plan fields)
    ("seed: 3,2,0,1 with DP", FOUR, dict(gpus="3,2,0,1", strategy="dp"), 64, "fp32",
     dict(strategy="dp", nproc_per_node=1, physical_ids=[3, 2, 0, 1], logical_ids=[0, 1, 2, 3],
          primary=3, physical_to_logical={3: 0, 2: 1, 0: 2, 1: 3}, backend="nccl",
          env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "3,2,0,1"})),
    ("auto takes every free card as DDP", FOUR, dict(), 64, "bf16",
     dict(strategy="ddp", nproc_per_node=4, physical_ids=[0, 1, 2, 3], backend="nccl")),
    ("a count picks the most free memory", FOUR, dict(gpus="2"), 64, "fp16",
     dict(strategy="ddp", physical_ids=[0, 1], primary=0)),
    ("seed: card 0 busy, use 2 and 3", EIGHT_BUSY0, dict(gpus="2,3", strategy="dp"), 64, "fp32",
     dict(strategy="dp", physical_ids=[2, 3], logical_ids=[0, 1], primary=2,
          env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "2,3"})),
    ("card 0 busy: auto skips it", EIGHT_BUSY0, dict(), 56, "fp32",
     dict(physical_ids=[1, 2, 3, 4, 5, 6, 7], nproc_per_node=7)),
    ("busy card allowed when skip_busy is off", EIGHT_BUSY0, dict(gpus="1", skip_busy=False), 8,
     "fp32", dict(strategy="single", physical_ids=[0])),
    ("inherited CUDA_VISIBLE_DEVICES=1,2 limits auto", INHERITED, dict(), 64, "fp32",
     dict(physical_ids=[1, 2], env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1,2"})),
    ("one named card", FOUR, dict(gpus="3,"), 8, "fp32",
     dict(strategy="single", physical_ids=[3], primary=3, nproc_per_node=1)),
    ("CPU host: DDP over gloo with 2 processes", CPU, dict(), 64, "bf16",
     dict(strategy="ddp", backend="gloo", device="cpu", nproc_per_node=2, physical_ids=[],
          env={"CUDA_VISIBLE_DEVICES": ""})),
    ("CPU host: single, the host's threads (torch's default)", CPU, dict(strategy="single"), 64, "fp32",
     dict(strategy="single", nproc_per_node=1, device="cpu", cpu_threads=None)),
    ("one-core CPU host: single", host(0, cpus=1), dict(), 64, "fp32",
     dict(strategy="single", nproc_per_node=1)),
    ("16 CPUs, 2 DDP processes: 8 threads each", host(0, cpus=16), dict(cpu_processes=2), 64, "fp32",
     dict(nproc_per_node=2, cpu_threads=8)),
    ("a sweep's trial on a slot of 1 core: 1 thread, not the host's 16", host(0, cpus=16),
     dict(cpu_processes=1, cpu_cores=1), 64, "fp32", dict(strategy="single", nproc_per_node=1, cpu_threads=1)),
    ("2 processes on a slot of 2 cores of 16", host(0, cpus=16), dict(cpu_processes=2, cpu_cores=2), 64, "fp32",
     dict(strategy="ddp", nproc_per_node=2, cpu_threads=1)),
]


@pytest.mark.parametrize("name,report,req,batch,precision,expected", PLANS, ids=[p[0] for p in PLANS])
def test_plan(name, report, req, batch, precision, expected):
    plan = assign_devices_for(report, PipelineParams(**req), batch, precision)
    for key, value in expected.items():
        assert getattr(plan, key) == value, key


ERRORS = [  # (host, request, batch, precision, locked, exact message fragment)
    ("id not present", FOUR, dict(gpus="5,1"), 64, "fp32", set(),
     "physical GPU 5 does not exist on fake; present: 0, 1, 2, 3"),
    ("id hidden by inherited CUDA_VISIBLE_DEVICES", INHERITED, dict(gpus="3,"), 64, "fp32", set(),
     "physical GPU 3 is hidden by the inherited CUDA_VISIBLE_DEVICES='1,2'; usable here: 1, 2"),
    ("more GPUs than free", EIGHT_BUSY0, dict(gpus="8"), 64, "fp32", set(),
     "needs 8 free GPU(s) but only 7 are free (GPU 0: busy (1 other processes))"),
    ("more GPUs than visible", INHERITED, dict(gpus="3"), 64, "fp32", set(),
     "asks for 3 GPUs but this process can use 2 (physical 1, 2)"),
    ("nccl without GPUs", CPU, dict(backend="nccl"), 64, "fp32", set(),
     "backend 'nccl' needs GPUs"),
    ("DP without GPUs", CPU, dict(strategy="dp"), 64, "fp32", set(),
     "strategy 'dp' (nn.DataParallel) needs GPUs"),
    ("GPUs asked on CPU host", CPU, dict(gpus="2"), 64, "fp32", set(),
     "gpus=2 asks for GPUs but none are usable on fake"),
    ("DP batch smaller than devices", FOUR, dict(gpus="3,2,0,1", strategy="dp"), 2, "fp32", set(),
     "global batch_size 2 is smaller than the 4 devices of this dp plan"),
    ("DDP batch smaller than devices", FOUR, dict(), 3, "fp32", set(),
     "global batch_size 3 is smaller than the 4 devices of this ddp plan"),
    ("DDP batch not divisible", FOUR, dict(), 6, "fp32", set(),
     "global batch_size 6 does not split evenly over 4 processes"),
    ("fp16 without CUDA", CPU, dict(), 64, "fp16", set(), "precision 'fp16' needs CUDA"),
    ("bf16 on a pre-Ampere card", host(2, cc="7.0"), dict(), 64, "bf16", set(),
     "precision 'bf16' needs compute capability >= 8.0 but GPU 0 (NVIDIA H100) has 7.0"),
    ("single with several cards", FOUR, dict(gpus="0,1", strategy="single"), 64, "fp32", set(),
     "strategy 'single' uses one GPU but gpus=0,1 gives 2"),
    ("card locked by another run", FOUR, dict(gpus="1,2"), 64, "fp32", {1},
     "physical GPU 1 is in use by another gpuflow run"),
    ("too little free memory", FOUR, dict(gpus="3,", min_free_mb=79_000), 64, "fp32", set(),
     "physical GPU 3 has 77000 MiB free, below min_free_mb=79000"),
    ("bf16 with DataParallel over 2 cards", FOUR, dict(gpus="0,1", strategy="dp"), 64, "bf16", set(),
     "precision 'bf16' with strategy 'dp' on 2 GPUs: nn.DataParallel's replicas run autocast in its default fp16"),
    ("a MIG instance inherited", host(1, cvd="MIG-4f9b7c1e-aaaa-bbbb-cccc-0123456789ab"), dict(), 64, "fp32", set(),
     "names the MIG instance MIG-4f9b7c1e-aaaa-bbbb-cccc-0123456789ab; gpuflow assigns whole GPUs"),
    ("a card inherited twice: CUDA sees none", host(4, cvd="2,2,3"), dict(), 64, "fp32", set(),
     "CUDA_VISIBLE_DEVICES='2,2,3' names a card twice, and CUDA then sees no GPU at all: name each card once"),
]


@pytest.mark.parametrize("name,report,req,batch,precision,locked,message", ERRORS,
                         ids=[e[0] for e in ERRORS])
def test_assignment_error(name, report, req, batch, precision, locked, message):
    with pytest.raises(AssignmentError) as err:
        assign_devices_for(report, PipelineParams(**req), batch, precision, locked=locked)
    assert message in str(err.value)


@pytest.mark.parametrize("gpus,message", [
    ("1,1", "names GPU 1 twice"), ("0", "use gpus=cpu"), ("two", "is not understood")])
def test_bad_gpu_request_forms(gpus, message):
    with pytest.raises(ValidationError, match=message):
        PipelineParams(gpus=gpus)


def test_auto_avoids_cards_locked_by_another_run():
    plan = assign_devices_for(FOUR, PipelineParams(), 64, locked={0, 2})
    assert plan.physical_ids == [1, 3]


def test_card_locks_exclude_each_other_and_die_with_their_holder(tmp_path):
    plan = assign_devices_for(FOUR, PipelineParams(gpus="3,2"), 64)
    a, b = CardLocks(tmp_path), CardLocks(tmp_path)
    a.acquire(plan)
    assert b.held_elsewhere(FOUR) == {2, 3}
    with pytest.raises(CardLockError, match="just taken"):
        b.acquire(plan)
    a.release()
    assert b.held_elsewhere(FOUR) == set()
    # a holder that is killed (no cleanup at all) releases its cards
    code = textwrap.dedent(f"""
        import sys, time; sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from gpuflow.tasks.devices.cards import CardLocks
        CardLocks(Path({str(tmp_path)!r})).try_lock("GPU-0001"); print("held", flush=True); time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    assert b.held_elsewhere(FOUR) == {1}
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert b.held_elsewhere(FOUR) == set()


CHILD = ("import json, os, torch; print(json.dumps({'cvd': os.environ.get('CUDA_VISIBLE_DEVICES'),"
         " 'order': os.environ.get('CUDA_DEVICE_ORDER'), 'count': torch.cuda.device_count()}))")


def test_another_runs_look_at_the_free_cards_never_fails_an_acquire(tmp_path):
    """held_elsewhere takes each card's lock for a moment: a run acquiring it then waits that moment out."""
    import threading

    plan = assign_devices_for(FOUR, PipelineParams(gpus="1,"), 64)
    looking = CardLocks(tmp_path)
    assert looking.try_lock("GPU-0001")
    threading.Timer(0.5, looking.release).start()  # the look ends
    CardLocks(tmp_path).acquire(plan)


def test_child_process_receives_the_plan():
    plan = assign_devices_for(FOUR, PipelineParams(gpus="3,1", strategy="dp"), 64)
    out = subprocess.run([sys.executable, "-c", CHILD], env={**os.environ, **plan.env},
                         capture_output=True, text=True, check=True).stdout
    seen = json.loads(out)
    assert seen["cvd"] == "3,1" and seen["order"] == "PCI_BUS_ID"
    if not read_environment(with_torch=False).gpus:
        assert seen["count"] == 0  # no such cards here: CUDA sees none


@pytest.mark.gpu
def test_child_sees_exactly_the_assigned_real_gpu():
    report = read_environment()
    plan = assign_devices_for(report, PipelineParams(gpus=f"{report.gpus[-1].index},"), 8)
    seen = json.loads(subprocess.run([sys.executable, "-c", CHILD], env={**os.environ, **plan.env},
                                     capture_output=True, text=True, check=True).stdout)
    assert seen["count"] == 1 and seen["cvd"] == str(report.gpus[-1].index)


# --- probe --------------------------------------------------------------------------


@pytest.mark.parametrize("gpus,expected", [
    ("auto", [0]), ("1", [0]), ("2,", [2]), ("cpu", [])])
def test_evaluation_takes_one_device_with_runs_gpus_grammar(gpus, expected):
    from gpuflow.tasks.devices.assign import one_device_plan

    plan = one_device_plan(FOUR, Devices(gpus=gpus))
    assert plan.physical_ids == expected and plan.strategy == "single" and plan.nproc_per_node == 1


@pytest.mark.parametrize("gpus,message", [
    ("3", "gpus=3 asks for several devices but this step uses one; name one card ('3,')"),
    ("3,2", "gpus=3,2 asks for several devices")])
def test_evaluation_refuses_several_devices_and_says_how_to_name_one(gpus, message):
    from gpuflow.tasks.devices.assign import one_device_plan

    with pytest.raises(AssignmentError, match=re.escape(message)):
        one_device_plan(FOUR, Devices(gpus=gpus))


def test_probe_on_this_host_never_raises_and_never_initialises_cuda(monkeypatch):
    import torch

    monkeypatch.setenv("GPUFLOW_TEST_SECRET", "hunter2-do-not-log")
    report = read_environment()
    assert report.torch_version == torch.__version__
    assert report.backends.get("gloo") is True
    assert not torch.cuda.is_initialized()
    assert "hunter2" not in report.model_dump_json()
    if not torch.cuda.is_available():
        assert report.gpus == [] and report.source in ("none", "nvidia-smi")


def _fake_nvml(bus_ids, procs=None):
    handles = list(range(len(bus_ids)))
    ns = SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(bus_ids), nvmlDeviceGetHandleByIndex=lambda i: handles[i],
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=80 * 2**30, free=(40 + h) * 2**30),
        nvmlDeviceGetCudaComputeCapability=lambda h: (9, 0),
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=10 * h),
        nvmlDeviceGetUUID=lambda h: f"GPU-nvml-{h}", nvmlDeviceGetPciInfo=lambda h: SimpleNamespace(busId=bus_ids[h].encode()),
        nvmlDeviceGetName=lambda h: b"NVIDIA H100 80GB HBM3",
        nvmlDeviceGetComputeRunningProcesses=lambda h: [object()] * (procs or {}).get(h, 0),
        nvmlSystemGetDriverVersion=lambda: "580.65.06", nvmlSystemGetCudaDriverVersion=lambda: 13000,
    )
    return ns


def test_probe_reads_nvml_and_numbers_cards_in_pci_bus_order():
    nvml = _fake_nvml(["00000000:41:00.0", "00000000:01:00.0"], procs={0: 2})
    report = read_environment(nvml=nvml, with_torch=False)
    assert report.source == "nvml" and report.driver_version == "580.65.06"
    assert report.cuda_version == "13.0"
    assert [(g.index, g.pci_bus_id, g.uuid) for g in report.gpus] == [
        (0, "00000000:01:00.0", "GPU-nvml-1"), (1, "00000000:41:00.0", "GPU-nvml-0")]
    assert report.gpus[1].processes == 2 and report.gpus[0].memory_free_mb == 41 * 1024
    assert report.bf16_supported


def test_probe_falls_back_to_nvidia_smi(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(textwrap.dedent("""\
        #!/bin/sh
        case "$*" in
          *compute-apps*) echo "GPU-bbb" ;;
          *) echo "0, GPU-aaa, 00000000:01:00.0, NVIDIA A100-SXM4-40GB, 8.0, 40960, 30000, 5, 550.1"
             echo "1, GPU-bbb, 00000000:02:00.0, NVIDIA A100-SXM4-40GB, 8.0, 40960, 100, 97, 550.1" ;;
        esac
    """))
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")

    def broken_nvml():
        raise RuntimeError("NVML Shared Library Not Found")

    report = read_environment(nvml=SimpleNamespace(nvmlInit=broken_nvml), with_torch=False)
    assert report.source == "nvidia-smi" and report.driver_version == "550.1"
    assert [g.processes for g in report.gpus] == [0, 1]
    assert report.gpus[1].utilization_pct == 97
    plan = assign_devices_for(report, PipelineParams(), 64)
    assert plan.physical_ids == [0]  # GPU 1 is busy


def test_report_is_json_serialisable():
    report = host(2, cvd="1")
    again = EnvironmentReport.model_validate_json(report.model_dump_json())
    assert again == report and again.visible_physical_ids() == [1]


def test_gpuflow_probe_command_prints_json_and_a_table():
    gpuflow = [sys.executable, "-m", "gpuflow.flows"]
    out = subprocess.run([*gpuflow, "probe", "--json"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    report = EnvironmentReport.model_validate_json(out)
    assert report.cpu_count == len(os.sched_getaffinity(0)) and report.backends["gloo"]
    table = subprocess.run([*gpuflow, "probe"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert report.hostname in table and "backends:" in table


def test_gpuflow_run_refuses_bad_values_before_starting_anything():
    proc = subprocess.run([sys.executable, "-m", "gpuflow.flows", "run", "--gpus", "1,1"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "names GPU 1 twice" in proc.stderr
    assert "Starting temporary server" not in proc.stderr + proc.stdout


def test_flow_probe_without_gpus_leaves_torch_unimported():
    import torch

    code = ("import sys; from gpuflow.tasks.devices.probe import read_environment; "
            "r = read_environment(import_torch=False); print(r.torch_version, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, check=True).stdout.split()
    if not read_environment(with_torch=False).gpus:  # with GPUs torch's view comes from a child
        assert out == [torch.__version__.split("+")[0], "False"]


def test_the_cpus_counted_are_the_ones_this_process_may_use():
    """A cpuset, Slurm or taskset gives a process fewer cores than the host has: plans count those."""
    code = ("import os; os.sched_setaffinity(0, {0}); from gpuflow.tasks.devices.probe import usable_cpus, "
            "read_environment; print(usable_cpus(), read_environment(with_torch=False).cpu_count)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.stdout.split() == ["1", "1"], out.stderr[-2000:]


@pytest.mark.parametrize("cvd", ["MIG-4f9b7c1e-aaaa-bbbb-cccc-0123456789ab", "1,1"])
def test_an_inherited_cuda_visible_devices_gpuflow_cannot_use_is_refused_by_evaluations_and_sweeps_too(cvd, tmp_path):
    """Their `auto` turned into the CPU before assignment looked at it: they went to the CPU without a word."""
    from gpuflow.flows.params import SweepParams
    from gpuflow.flows.trial import Slots
    from gpuflow.tasks.devices.assign import one_device_plan

    report = host(2, cvd=cvd)
    with pytest.raises(AssignmentError, match="CUDA_VISIBLE_DEVICES"):
        one_device_plan(report, Devices(gpus="auto"))
    (tmp_path / "s.yaml").write_text("lr: {type: float, low: 0.001, high: 0.1}\n")
    with pytest.raises(AssignmentError, match="CUDA_VISIBLE_DEVICES"):
        Slots(SweepParams(space=str(tmp_path / "s.yaml"), tracking_uri=f"sqlite:///{tmp_path / 'm.db'}"), report,
              probe=lambda: report)
    assert one_device_plan(report, Devices(gpus="cpu")).device == "cpu"  # asked for the CPU: as asked


def test_cpu_sweeps_in_disjoint_cpusets_take_slots_side_by_side(tmp_path, monkeypatch):
    """A CPU slot's locks are named by the ids of the cores this process may use: sweeps confined to different
    cores of one host (cpusets, Slurm, taskset) never wait for each other; by index, both locked cpu0 and cpu1."""
    import os

    from gpuflow.flows.params import SweepParams
    from gpuflow.flows.trial import Slots

    monkeypatch.setenv("GPUFLOW_LOCK_DIR", str(tmp_path / "locks"))
    (tmp_path / "s.yaml").write_text("lr: {type: float, low: 0.001, high: 0.1}\n")
    params = SweepParams(space=str(tmp_path / "s.yaml"), tracking_uri=f"sqlite:///{tmp_path / 'm.db'}",
                         gpus="cpu", parallel=1)
    taken = []
    for cores in ({0, 1}, {2, 3}):  # two sweeps, one cpuset each
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, cores=cores: cores)
        taken.append(Slots(params, host(0, cpus=2), probe=lambda: host(0, cpus=2)).take())
    assert all(taken), "the second sweep waited for cores the first does not use"
    assert sorted(p.name.split("-cpu")[1] for p in (tmp_path / "locks").glob("*-cpu*.lock")) == \
        ["0.lock", "1.lock", "2.lock", "3.lock"]
    for slot in taken:
        slot.lock.release()
