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
- FORGELINE_DEVICE=cuda on a node whose devices are GPUs: a rank that sees none there fails as
  a broken node's (trainer.runtime) instead of training on the CPU, slowly and unnoticed.
- CUDA_VISIBLE_DEVICES: the GPUs the scheduler granted the job on this node
  (infra.gpu_devices), so two jobs packed on one node never share a device: each rank's
  `cuda:LOCAL_RANK` is then one of its job's own GPUs.
- TORCH_GLOO_LAZY_INIT: a gloo group (checkpoints' collectives, the step's small exchanges)
  connects a pair of ranks at their first exchange, not every pair when it is made: its ring
  collectives then hold a few connections a rank instead of one to each of thousands (and
  the rank's file limit, which trainer.runtime also raises to the hard limit).
- The compile caches: the kernels `torch.compile` built for this run on this node, kept in the
  run's folder across its restarts (a restart would otherwise compile again for minutes). The
  run's own: a cache shared with another run would be code planted for it.

What the operator set on the agent wins over each of these but the compile caches, which are
always the run's own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from infra.gpu_devices import visible_devices

# Collectives each rank remembers for the flight recorder's dump.
NCCL_TRACE_ENTRIES = 2000


# Set for a job on a node whose devices are GPUs: a rank that finds no CUDA device there is on a
# broken node (trainer.runtime), not one to train on the CPU instead.
DEVICE_VARIABLE = "FORGELINE_DEVICE"


@dataclass(frozen=True)
class GrantedDevices:
    """The node's devices a job holds, as its grant names them (Allocation.devices_on)."""

    indices: Sequence[int]  # in PCI bus order (on a node without GPUs: its rank slots)
    cuda: bool  # the node's devices are GPUs


def device_environment(
    agent_env: Mapping[str, str],
    generation_dir: Path,
    compile_cache: Path,
    devices: GrantedDevices | None = None,
) -> dict[str, str]:
    """The CUDA side of a job's environment: `generation_dir` holds the generation's files (the
    flight recorder's dumps go there), `compile_cache` is the run's compile cache on this node,
    `devices` what the job holds of the node (None: every GPU the agent has)."""
    defaults = {
        "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(NCCL_TRACE_ENTRIES),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        # The prefix of each rank's dump: the rank's number is appended.
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(generation_dir / "nccl-trace-rank-"),
        "TORCH_GLOO_LAZY_INIT": "1",
    }
    env = {
        **{name: agent_env.get(name, value) for name, value in defaults.items()},
        "TORCHINDUCTOR_CACHE_DIR": str(compile_cache / "inductor"),
        "TRITON_CACHE_DIR": str(compile_cache / "triton"),
    }
    if devices is not None:  # the scheduler's word, over whatever the agent was given
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(devices.indices, agent_env)
        if devices.cuda:
            env[DEVICE_VARIABLE] = "cuda"
    return env
