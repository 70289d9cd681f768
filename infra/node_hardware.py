"""What a node has to train with: its devices, their type and memory, and their peak FLOP/s.

MFU is only as true as the peak it divides by. On a GPU host the devices come from NVML
(`nvidia-ml-py`) and the peak from the vendor's dense bf16 figure for the model (measured with
a matmul when the model is not in the table). On a CPU-only host a "GPU" is a rank slot (one
rank process) and the peak is measured once at start: the best of a few float32 matmuls on one
thread, which is what a rank with `threads_per_rank = 1` can reach.

A measurement is only as good as the quiet it ran in. The local stack's pretend nodes share one
machine and start together, beside a Temporal and an MLflow server starting too: measured there,
the peak came out at a third of this machine's (a run's MFU read 110 %). So `forgeline up`
measures once, before it starts anything, and hands the figure to every agent it starts
(`measured_peak`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

CPU = "cpu"
# Long enough for a GPU's first CUDA context and a few dozen large matmuls.
_MEASURE_TIMEOUT_S = 120
# Dense bf16 tensor-core peaks (no sparsity) from the vendors' data sheets, by a substring of the
# name NVML reports. Longest match first, so "H100 PCIe" is not taken for an SXM part.
_GPU_PEAK_FLOPS = {
    "GB200": 2.5e15,
    "B200": 2.25e15,
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 70e12,
    "A10": 125e12,
}
# A CPU thread's peak from 1024² float32 matmuls, one at a time; a GPU's from 8192² bf16 ones,
# 20 back to back between two syncs: one small matmul a timing measures a GPU's launch and
# sync latency, not its tensor cores (3 to 10 times below the data sheet, MFU above 100 %).
_MATMUL_SIDE = {"cpu": 1024, "cuda": 8192}
_MATMULS_PER_TIMING = {"cpu": 1, "cuda": 20}
_TIMINGS = 8


@dataclass(frozen=True)
class NodeHardware:
    gpus: int  # devices, or rank slots on a CPU-only host
    gpu_type: str  # a slug of the device model ("h100-80gb-hbm3"), "cpu" without GPUs
    memory_bytes: int  # per device (a CPU host's memory shared by its slots)
    peak_flops: float  # per device; per thread for a CPU slot
    peak_source: str  # "datasheet" or "measured": how far to trust the MFU it gives

    def describe(self) -> str:
        kind = "GPUs" if self.gpu_type != CPU else "CPU rank slots"
        return (
            f"{self.gpus} {kind} ({self.gpu_type}, {self.memory_bytes / 2**30:.0f} GiB each, "
            f"peak {self.peak_flops:.3g} FLOP/s {self.peak_source})"
        )


def gpu_type_slug(name: str) -> str:
    """NVML's name as a spec's `resources.gpu_type` can name it: "NVIDIA H100 80GB HBM3" →
    "h100-80gb-hbm3"."""
    words = name.replace("NVIDIA", "").replace("Tesla", "").split()
    return "-".join(w.lower() for w in words) or "gpu"


def datasheet_peak(name: str) -> float | None:
    for model in sorted(_GPU_PEAK_FLOPS, key=len, reverse=True):
        if model in name:
            return _GPU_PEAK_FLOPS[model]
    return None


def measured_matmul_peak(device: str = "cpu") -> float:
    """The best FLOP/s of square matmuls (float32 on CPU, one thread; bf16 on a GPU), each
    timing a run of them between two syncs. Measure a GPU in a process of its own
    (`measured_in_a_child`): this one keeps a CUDA context for as long as it lives."""
    import torch  # late: `forgeline agent --help` should not pay for it

    side, per_timing = _MATMUL_SIDE[device], _MATMULS_PER_TIMING[device]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        a = torch.randn(side, side, device=device, dtype=dtype)
        b = torch.randn(side, side, device=device, dtype=dtype)
        best = float("inf")
        for _ in range(_TIMINGS + 1):  # the first warms caches and kernels up
            sync()
            started = time.perf_counter()
            for _ in range(per_timing):
                torch.mm(a, b)
            sync()
            best = min(best, (time.perf_counter() - started) / per_timing)
        return 2 * side**3 / best
    finally:
        torch.set_num_threads(threads)


def measured_in_a_child(device: str) -> float:
    """`measured_matmul_peak(device)` in a process of its own, so the agent, which lives for
    weeks, never holds a CUDA context (memory on the GPU its jobs need, and a process that a
    driver reset must kill)."""
    done = subprocess.run(
        [sys.executable, "-m", __name__, device],
        capture_output=True, text=True, timeout=_MEASURE_TIMEOUT_S, check=True,
    )  # fmt: skip
    return float(done.stdout.strip().splitlines()[-1])


def _nvml_devices() -> list[tuple[str, int]]:
    """(name, memory in bytes) of each GPU NVML sees; empty without NVML or GPUs."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # no driver: a CPU-only host
        return []
    try:
        devices = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            devices.append((name, int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)))
        return devices
    finally:
        pynvml.nvmlShutdown()


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def discover(
    slots: int | None = None, cpu_only: bool = False, measured_peak: float | None = None
) -> NodeHardware:
    """This host's devices. `slots` overrides the count (fewer GPUs than the host has, or the
    number of CPU rank processes; without GPUs the default is one slot per core). `cpu_only`:
    rank slots even where there are GPUs (the local stack's pretend nodes share one machine).
    `measured_peak`: a CPU slot's peak as measured already, in a quieter moment."""
    devices = [] if cpu_only else _nvml_devices()
    if devices:
        name, memory = devices[0]
        peak = datasheet_peak(name)
        count = len(devices) if slots is None else min(slots, len(devices))
        return NodeHardware(
            gpus=count,
            gpu_type=gpu_type_slug(name),
            memory_bytes=memory,
            peak_flops=peak or measured_in_a_child("cuda"),
            peak_source="datasheet" if peak else "measured",
        )
    return NodeHardware(
        gpus=slots or os.cpu_count() or 1,
        gpu_type=CPU,
        memory_bytes=_host_memory_bytes(),
        peak_flops=measured_peak or measured_matmul_peak(),
        peak_source="measured",
    )


if __name__ == "__main__":
    # python -m infra.node_hardware DEVICE: print the measured peak (measured_in_a_child).
    print(measured_matmul_peak(sys.argv[1]))
