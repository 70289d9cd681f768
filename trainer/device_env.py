"""What a node agent tells a job's processes (torchrun, its standby, the ranks) about the CUDA
stack, beside the fabric (trainer.launch.Fabric) and the job's own settings.

Nothing here changes a CPU run; each line is there for the first run on a GPU node:

- PYTORCH_NVML_BASED_CUDA_CHECK: torchrun calls `torch.cuda.is_available()` before it forks the
  ranks (`--start-method fork`, trainer.launch). Without NVML's answer that call initializes
  CUDA in torchrun, and every forked rank then fails its first CUDA call ("Cannot re-initialize
  CUDA in forked subprocess").
- CUDA_DEVICE_ORDER: device numbers in PCI bus order, as nvidia-smi, NVML and the scheduler
  count them, not CUDA's default fastest-first order, which can differ on a mixed node.
- The NCCL flight recorder: each rank keeps its last collectives and writes them beside the
  generation's other files when a collective times out, so a hang names the collective and
  the rank that never joined it.
- CUDA_VISIBLE_DEVICES: the GPUs the scheduler granted the job on this node
  (infra.gpu_devices), so two jobs packed on one node never share a device: each rank's
  `cuda:LOCAL_RANK` is then one of its job's own GPUs.
- The compile caches: the kernels `torch.compile` built for this run on this node, kept in the
  run's folder across its restarts (a restart would otherwise compile again for minutes). The
  run's own: a cache shared with another run would be code planted for it.

What the operator set on the agent wins over each of these but the compile caches, which are
always the run's own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from infra.gpu_devices import visible_devices

# Collectives each rank remembers for the flight recorder's dump.
NCCL_TRACE_ENTRIES = 2000


def device_environment(
    agent_env: Mapping[str, str],
    generation_dir: Path,
    compile_cache: Path,
    devices: Sequence[int] | None = None,
) -> dict[str, str]:
    """The CUDA side of a job's environment: `generation_dir` holds the generation's files (the
    flight recorder's dumps go there), `compile_cache` is the run's compile cache on this node,
    `devices` the node's GPUs the job holds (by index; None: every GPU the agent has)."""
    defaults = {
        "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(NCCL_TRACE_ENTRIES),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        # The prefix of each rank's dump: the rank's number is appended.
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(generation_dir / "nccl-trace-rank-"),
    }
    env = {
        **{name: agent_env.get(name, value) for name, value in defaults.items()},
        "TORCHINDUCTOR_CACHE_DIR": str(compile_cache / "inductor"),
        "TRITON_CACHE_DIR": str(compile_cache / "triton"),
    }
    if devices is not None:  # the scheduler's word, over whatever the agent was given
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(devices, agent_env)
    return env
