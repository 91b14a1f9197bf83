"""Environment probing: GPUs, driver/CUDA/cuDNN/NCCL, free memory, backends.

CUDA is never initialised here, so each launch can still choose its CUDA_VISIBLE_DEVICES: GPUs are read through
NVML (or nvidia-smi), torch's view in a child process.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import socket
import subprocess
import sys

from prefect import task
from pydantic import BaseModel, Field


class GpuInfo(BaseModel):
    index: int = Field(description="physical index in PCI bus order (nvidia-smi numbering)")
    uuid: str
    pci_bus_id: str
    name: str
    compute_capability: str = ""
    memory_total_mb: int = 0
    memory_free_mb: int = 0
    utilization_pct: int | None = None
    processes: int = 0

    @property
    def bf16(self) -> bool:
        major = self.compute_capability.split(".")[0]
        return major.isdigit() and int(major) >= 8


class EnvironmentReport(BaseModel):
    hostname: str
    cpu_count: int
    source: str = Field(description="where GPU facts came from: nvml, nvidia-smi or none")
    gpus: list[GpuInfo] = []
    driver_version: str | None = None
    cuda_version: str | None = None
    cudnn_version: str | None = None
    nccl_version: str | None = None
    torch_version: str | None = None
    torch_device_count: int | None = None
    backends: dict[str, bool] = Field({}, description="torch.distributed backends; empty when the flow "
                                      "probed a host without GPUs (torch not imported there)")
    bf16_supported: bool = True
    cuda_visible_devices: str | None = None
    cuda_device_order: str | None = None
    unknown: dict[str, str] = Field({}, description="why a version above is missing (null)")
    warnings: list[str] = []

    def version(self, name: str) -> str:
        """A version for people: the value, or 'unknown (why)'; never 'None'."""
        value = getattr(self, f"{name}_version")
        return value if value is not None else f"unknown ({self.unknown.get(name, 'not reported')})"

    def visible_physical_ids(self) -> list[int]:
        """Physical ids this process may use, after an inherited CUDA_VISIBLE_DEVICES."""
        return parse_visible(self.cuda_visible_devices, self.gpus)


def parse_visible(cvd: str | None, gpus: list[GpuInfo]) -> list[int]:
    """Map a CUDA_VISIBLE_DEVICES value (indices or UUIDs) to physical ids, in its order."""
    ids = [g.index for g in gpus]
    if cvd is None:
        return ids
    out: list[int] = []
    for tok in filter(None, (t.strip() for t in cvd.split(","))):
        idx = int(tok) if tok.isdigit() else next((g.index for g in gpus if g.uuid.startswith(tok)), None)
        if idx in out:
            return []  # a repeated ordinal: CUDA sees no device at all (torch.cuda._parse_visible_devices)
        if idx not in ids:
            break  # CUDA stops at the first invalid entry
        out.append(idx)
    return out


def cvd_refusal(cvd: str | None, gpus: list[GpuInfo]) -> str | None:
    """Why gpuflow cannot use the cards an inherited CUDA_VISIBLE_DEVICES value names; None when it can."""
    tokens = [t.strip() for t in (cvd or "").split(",") if t.strip()]
    if mig := next((t for t in tokens if t.startswith("MIG-")), None):
        return (f"names the MIG instance {mig}; gpuflow assigns whole GPUs, so it would see none here: run it where "
                "whole cards are visible")
    if tokens and not parse_visible(cvd, gpus) and parse_visible(tokens[0], gpus):
        return "names a card twice, and CUDA then sees no GPU at all: name each card once"
    return None


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a cpuset, Slurm, taskset), not all of the host's."""
    return len(usable_cpu_ids())


def usable_cpu_ids() -> list[int]:
    """The ids of the CPUs this process may run on, in order."""
    try:
        return sorted(os.sched_getaffinity(0)) or [0]
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def gpus_from_nvml(nvml=None) -> tuple[list[GpuInfo], str | None, str | None]:
    """(gpus, driver, cuda driver version) from NVML; raises if NVML is unusable."""
    if nvml is None:
        import pynvml as nvml
    nvml.nvmlInit()
    try:
        gpus = []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(h)
            try:
                util = nvml.nvmlDeviceGetUtilizationRates(h).gpu
            except Exception:
                util = None
            gpus.append(GpuInfo(
                index=i, uuid=_text(nvml.nvmlDeviceGetUUID(h)),
                pci_bus_id=_text(nvml.nvmlDeviceGetPciInfo(h).busId),
                name=_text(nvml.nvmlDeviceGetName(h)),
                compute_capability=f"{major}.{minor}",
                memory_total_mb=mem.total // 2**20, memory_free_mb=mem.free // 2**20,
                utilization_pct=util,
                processes=len(nvml.nvmlDeviceGetComputeRunningProcesses(h)),
            ))
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        cv = nvml.nvmlSystemGetCudaDriverVersion()
        return _pci_order(gpus), driver, f"{cv // 1000}.{cv % 1000 // 10}"
    finally:
        nvml.nvmlShutdown()


def _pci_order(gpus: list[GpuInfo]) -> list[GpuInfo]:
    """Renumber by PCI bus id: the order CUDA_DEVICE_ORDER=PCI_BUS_ID gives."""
    ordered = sorted(gpus, key=lambda g: g.pci_bus_id.lower())
    return [g.model_copy(update={"index": i}) for i, g in enumerate(ordered)]


SMI_QUERY = "index,uuid,pci.bus_id,name,compute_cap,memory.total,memory.free,utilization.gpu,driver_version"


def gpus_from_smi() -> tuple[list[GpuInfo], str | None]:
    """(gpus, driver) from nvidia-smi's CSV output; raises if it is missing or fails."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        raise FileNotFoundError("nvidia-smi not on PATH")
    run = lambda *a: subprocess.run([smi, *a, "--format=csv,noheader,nounits"], capture_output=True,
                                    text=True, timeout=30, check=True).stdout
    num = lambda s: int(float(s)) if s.replace(".", "", 1).isdigit() else None  # "[N/A]" and the like: None
    busy = collections.Counter(u.strip() for u in run("--query-compute-apps=gpu_uuid").splitlines() if u.strip())
    gpus, driver = [], None
    for line in run(f"--query-gpu={SMI_QUERY}").splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) < 9:
            continue
        gpus.append(GpuInfo(index=int(f[0]), uuid=f[1], pci_bus_id=f[2], name=f[3],
                            compute_capability=f[4], memory_total_mb=num(f[5]) or 0,
                            memory_free_mb=num(f[6]) or 0, utilization_pct=num(f[7]),
                            processes=busy[f[1]]))
        driver = f[8]
    return _pci_order(gpus), driver


TORCH_PROBE = r"""
import json, torch, torch.distributed as dist
cuda = torch.cuda.is_available()
nccl = None
try:
    v = torch.cuda.nccl.version() if cuda else None
    nccl = ".".join(map(str, v)) if isinstance(v, tuple) else (str(v) if v else None)
except Exception:
    pass
print(json.dumps({
    "torch_version": torch.__version__, "cuda_version": torch.version.cuda,
    "cudnn_version": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None,
    "nccl_version": nccl, "torch_device_count": torch.cuda.device_count() if cuda else 0,
    "bf16": bool(torch.cuda.is_bf16_supported()) if cuda else True,
    "backends": {"nccl": dist.is_nccl_available(), "gloo": dist.is_gloo_available(),
                 "mpi": dist.is_mpi_available()},
}))
"""


def torch_view_no_gpu() -> dict:
    """Versions and backends without touching the CUDA runtime (nothing here initialises it)."""
    import torch
    import torch.distributed as dist

    return {"torch_version": torch.__version__, "cuda_version": torch.version.cuda,
            "cudnn_version": None, "nccl_version": None, "torch_device_count": 0, "bf16": True,
            "backends": {"nccl": dist.is_nccl_available(), "gloo": dist.is_gloo_available(),
                         "mpi": dist.is_mpi_available()}}


def torch_view_metadata() -> dict:
    """torch's version from its package metadata, without importing it (backends and CUDA build not read)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return {"torch_version": version("torch"), "torch_device_count": 0, "bf16": True}
    except PackageNotFoundError:
        return {"error": ["torch is not installed in this environment"]}


def torch_view(timeout: float = 120) -> dict:
    """torch's own view, taken in a child process so the parent never initialises CUDA."""
    proc = subprocess.run([sys.executable, "-c", TORCH_PROBE], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1:] or ["torch probe failed"]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def read_environment(nvml=None, with_torch: bool = True, import_torch: bool = True) -> EnvironmentReport:
    """Probe this host; a missing GPU or NVML gives a CPU-only report, never an error.

    with_torch=False leaves torch out; import_torch=False, on a host without GPUs, reads only torch's version."""
    warnings: list[str] = []
    gpus, driver, source, cuda_driver = [], None, "none", None
    try:
        gpus, driver, cuda_driver = gpus_from_nvml(nvml)
        source = "nvml"
    except Exception as e:  # no library, no driver, no GPU
        try:
            gpus, driver = gpus_from_smi()
            source = "nvidia-smi"
        except Exception as e2:
            if shutil.which("nvidia-smi") or "LibraryNotFound" not in type(e).__name__:
                warnings.append(f"no GPU information: NVML: {e}; nvidia-smi: {e2}")
    # with GPUs, torch's view needs the CUDA runtime, so a child takes it; without, nothing can initialise CUDA
    no_gpu_view = torch_view_no_gpu if import_torch else torch_view_metadata
    tv = (torch_view() if gpus else no_gpu_view()) if with_torch else {}
    if "error" in tv:
        warnings.append(f"torch probe failed: {tv['error']}")
    report = EnvironmentReport(
        hostname=socket.gethostname(), cpu_count=usable_cpus(), source=source, gpus=gpus,
        driver_version=driver, cuda_version=tv.get("cuda_version") or cuda_driver,
        cudnn_version=tv.get("cudnn_version"), nccl_version=tv.get("nccl_version"),
        torch_version=tv.get("torch_version"), torch_device_count=tv.get("torch_device_count"),
        backends=tv.get("backends", {}),
        bf16_supported=all(g.bf16 for g in gpus) if gpus else True,
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        cuda_device_order=os.environ.get("CUDA_DEVICE_ORDER"), warnings=warnings,
    )
    report.unknown = why_unknown(report, tv, with_torch)
    visible = report.visible_physical_ids()
    if report.torch_device_count is not None and gpus and report.torch_device_count != len(visible):
        report.warnings.append(
            f"torch sees {report.torch_device_count} GPUs but {source} lists {len(visible)} "
            "visible ones; check the driver and CUDA_VISIBLE_DEVICES")
    if report.cuda_visible_devices is not None and report.cuda_device_order != "PCI_BUS_ID":
        report.warnings.append(
            "inherited CUDA_VISIBLE_DEVICES is read in PCI bus order (nvidia-smi numbering); "
            "set CUDA_DEVICE_ORDER=PCI_BUS_ID so other tools agree")
    return report


def why_unknown(report: EnvironmentReport, tv: dict, with_torch: bool) -> dict[str, str]:
    """The reason for each version the probe could not read."""
    torch_why = ("; ".join(tv.get("error", [])) or "torch did not report it") if with_torch else "torch not probed"
    no_gpu = "no GPU on this host: it loads with the CUDA runtime"
    reasons = {
        "driver": "no NVIDIA driver found: neither NVML nor nvidia-smi answered" if report.source == "none"
        else f"{report.source} did not report it",
        "torch": torch_why,
        "cuda": (torch_why if "error" in tv or not with_torch else
                 "not read: torch was not imported on this GPU-less host (`gpuflow probe` reads it)"
                 if "cuda_version" not in tv else f"torch {report.torch_version} is a CPU-only build"),
        "cudnn": no_gpu if not report.gpus else torch_why,
        "nccl": no_gpu if not report.gpus else torch_why,
    }
    return {k: v for k, v in reasons.items() if getattr(report, f"{k}_version") is None}


@task(name="probe-environment")
def probe_environment() -> EnvironmentReport:
    """Report GPUs, versions and backends of this host without initialising CUDA (nor, without GPUs, importing
    torch: nothing in the plan depends on its backends)."""
    return read_environment(import_torch=False)
