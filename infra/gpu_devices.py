"""Which of a node's GPUs a job is shown, once the scheduler has said which it holds
(`Allocation.devices_on`: indices in PCI bus order, as NVML and nvidia-smi count them).

Two views of the same GPUs must agree: `CUDA_VISIBLE_DEVICES` for the job's processes, so that
`cuda:LOCAL_RANK` is the job's own GPU and not GPU LOCAL_RANK of the node, and the device files
its box shows (`infra.sandbox.Box.gpus`), so that a process that ignores the variable still
cannot open another job's GPU. The files are named by the driver's minor number, which NVML
reports per GPU; it usually equals the index but is not promised to.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def visible_devices(indices: Sequence[int], agent_env: Mapping[str, str]) -> str:
    """CUDA_VISIBLE_DEVICES for a job holding the node's GPUs `indices`. An agent that was
    itself given a subset of the host's GPUs (its own CUDA_VISIBLE_DEVICES) counts its node's
    GPUs in that subset, so index i is the i-th it was given."""
    own = [part.strip() for part in agent_env.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    own = [part for part in own if part]
    if not own:
        return ",".join(str(i) for i in indices)
    return ",".join(own[i] for i in indices if i < len(own))


def device_minors(indices: Sequence[int], agent_env: Mapping[str, str]) -> tuple[int, ...] | None:
    """The minor numbers of the GPUs `indices` (their files /dev/nvidia<minor>), from NVML;
    None when they cannot be told apart here: no NVML (a CPU-only node, where there is no
    file to hide), or an agent given GPUs by UUID or MIG slice, which this does not map (the
    box then shows every GPU file and the variable alone keeps jobs apart)."""
    physical = visible_devices(indices, agent_env).split(",") if indices else []
    if not all(part.isdigit() for part in physical):
        return None
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        return tuple(
            int(pynvml.nvmlDeviceGetMinorNumber(pynvml.nvmlDeviceGetHandleByIndex(int(p))))
            for p in physical
        )
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()
