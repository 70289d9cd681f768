"""Whether an error a rank raised is the platform's (the fabric's, a device's, the node's)
rather than the script's, and whether the node it ran on is broken.

Before its first step a script's exception is taken for the user's mistake: the run fails at
once, without a retry (trainer.entry). The platform's faults surface there too: a peer gone
from the rendezvous or a collective (the fabric), and on a GPU node the first CUDA call (a
device that is gone or fails its ECC check, a driver that does not match, CUDA that a forked
rank cannot initialize, memory another tenant of the device holds). Failing the run for those
would blame the user for the platform; they are crashes instead, and the run restarts from its
last checkpoint as it does for a dead node. When in doubt it is the platform's: taking its
fault for the user's costs the run, taking a user's for the platform's costs a few retries.

Some of a device's errors also say the node is broken (the hardware or its driver), whoever's
code was running: that node is taken out of service (trainer.launch.NodeFault, its agent's
health check) instead of being handed the restarted gang again. Others may be the script's
as much as the node's (out of memory, a failed cuBLAS call, a device-side assert): the run
restarts, the node stays.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Words of gloo's, NCCL's and the c10d store's errors when a peer vanishes, lower-cased.
_FABRIC_WORDS = ("gloo", "nccl", "connection", "peer", "rendezvous", "timed out", "socket")
# What the node's hardware or driver says when it is broken: no script causes these.
_BROKEN_NODE_WORDS = (
    "ecc error",
    "uncorrectable",
    "no cuda-capable device",
    "cuda-capable device(s) is/are busy or unavailable",
    "cuda driver version is insufficient",
    "found no nvidia driver",
    "nvml",
    "gpu is lost",
    "fallen off the bus",
    "fell off the bus",
)
# What CUDA and its libraries say of a device error that may be the script's as well.
_DEVICE_WORDS = (
    *_BROKEN_NODE_WORDS,
    "cuda error",
    "cuda out of memory",
    "cannot re-initialize cuda in forked subprocess",
    "cuda driver",
    "cublas_status",
    "cudnn_status",
    "cusolver_status",
    "device-side assert",
)
# torch's own classes for them (AcceleratorError: a CUDA runtime error, torch 2.8 and later).
_DEVICE_ERRORS: tuple[type[BaseException], ...] = tuple(
    cls for cls in (getattr(torch, "AcceleratorError", None), torch.OutOfMemoryError) if cls
)


def is_fabric_fault(err: BaseException) -> bool:
    """A distributed error, or one that names the fabric."""
    return isinstance(err, dist.DistError) or _says(err, _FABRIC_WORDS)


def is_device_fault(err: BaseException) -> bool:
    """An error of a device or its driver, by its class or its words."""
    return isinstance(err, _DEVICE_ERRORS) or _says(err, _DEVICE_WORDS)


def is_broken_node(err: BaseException) -> bool:
    """A device error that says the node's hardware or driver is broken."""
    return _says(err, _BROKEN_NODE_WORDS, also=_DEVICE_ERRORS)


def _says(
    err: BaseException, words: tuple[str, ...], also: tuple[type[BaseException], ...] = ()
) -> bool:
    """Whether `err` is a RuntimeError (or one of `also`) whose message holds one of `words`."""
    if not isinstance(err, (RuntimeError, *also)):
        return False
    message = str(err).lower()
    return any(word in message for word in words)
