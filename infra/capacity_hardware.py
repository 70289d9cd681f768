"""What the planner assumes about the machines: read from a cluster TOML file, or an H100 node.

The file may also be the scheduler's cluster file (`forgeline cluster apply`): its keys are
accepted, and `cost_per_gpu_hour` is shared. Any other key is an error naming it, so a typo
(`mfu_assumed`) never silently leaves a default in place.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from infra.errors import InfraError
from infra.toml_files import read_toml


class PlanError(InfraError):
    """A planning input cannot be used; the message names the field and the fix."""


@dataclass(frozen=True)
class Hardware:
    # An H100 SXM node: 80 GiB HBM3, 989 TFLOP/s dense bf16, 8 GPUs on NVLink.
    gpu_memory_gib: float = 80.0
    gpus_per_node: int = 8
    peak_flops_per_gpu: float = 989e12
    mfu: float = 0.4  # what a well-tuned dense-transformer run reaches at scale
    # Ranks stage their shards on node-local disk first (DESIGN: checkpoints), so the training
    # stall is the node's write speed; `write_gb_per_s` caps the whole gang (shared storage).
    write_gb_per_s_per_node: float = 5.0
    write_gb_per_s: float | None = None
    cost_per_gpu_hour: float = 2.0
    node_mtbf_hours: float | None = None  # None: the spec's recovery.node_mtbf_hours
    restart_s: float = 300.0  # detect, swap a spare, rendezvous, load the checkpoint
    usable_memory_fraction: float = 0.9  # the rest: CUDA context, NCCL buffers, fragmentation
    flash_attention: bool = True  # fused attention: no T×T score matrices kept for backward
    # Where the planner's layout proposal weighs communication (infra/capacity_layouts.py):
    # each GPU's share of the fabric between nodes (400 Gb/s InfiniBand a GPU) and NVLink's
    # bandwidth inside a node.
    network_gb_per_s_per_gpu: float = 50.0
    nvlink_gb_per_s: float = 450.0


# (lowest, lowest allowed, highest) for each number; `None` in a bound: no bound.
_RANGES: dict[str, tuple[float, bool, float | None]] = {
    "gpu_memory_gib": (0, False, None),
    "gpus_per_node": (1, True, 1024),
    "peak_flops_per_gpu": (0, False, None),
    "mfu": (0, False, 1),
    "write_gb_per_s_per_node": (0, False, None),
    "write_gb_per_s": (0, False, None),
    "cost_per_gpu_hour": (0, True, None),
    "node_mtbf_hours": (0, False, None),
    "restart_s": (0, True, None),
    "usable_memory_fraction": (0, False, 1),
    "network_gb_per_s_per_gpu": (0, False, None),
    "nvlink_gb_per_s": (0, False, None),
}


def _shown(value: object) -> str:
    """The value as the file wrote it, cut: a megabyte string must not become the message."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:79]}…"


def _check(key: str, value: object, where: str) -> object:
    if key == "flash_attention":
        if not isinstance(value, bool):
            raise PlanError(f"{where}: {key} = {_shown(value)} must be true or false")
        return value
    kind = "a whole number" if key == "gpus_per_node" else "a number"
    wrong_type = not isinstance(value, int | float) or isinstance(value, bool)
    if wrong_type or (key == "gpus_per_node" and not isinstance(value, int)):
        raise PlanError(f"{where}: {key} = {_shown(value)} must be {kind}")
    low, inclusive, high = _RANGES[key]
    if value < low or (value == low and not inclusive) or (high is not None and value > high):
        bound = f"{'≥' if inclusive else '>'} {low:g}" + (f" and ≤ {high:g}" if high else "")
        raise PlanError(f"{where}: {key} = {_shown(value)} must be {bound}")
    return value


def hardware_from_dict(
    data: dict, where: str, other_keys: frozenset[str] = frozenset()
) -> Hardware:
    """The planner's keys from `data`; `other_keys` (another reader's) are passed over."""
    own = {f.name for f in fields(Hardware)}
    unknown = sorted(set(data) - own - other_keys)
    if unknown:
        raise PlanError(
            f"{where}: unknown key {unknown[0]!r}: the planner reads {', '.join(sorted(own))}"
            + (" (and the cluster file's own keys)" if other_keys else "")
        )
    return Hardware(**{k: _check(k, v, where) for k, v in data.items() if k in own})


def load_hardware(path: Path, other_keys: frozenset[str] = frozenset()) -> Hardware:
    data = read_toml(path, PlanError, "cluster file")
    return hardware_from_dict(data, str(path), other_keys)
