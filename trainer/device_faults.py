"""Whether an error a rank raised before its first step is the device's or the driver's rather
than the script's.

Before its first step a script's exception is taken for the user's mistake: the run fails at
once, without a retry (trainer.entry). A GPU node's faults surface there too, in the first CUDA
call: a device that is gone or fails its ECC check, a driver that does not match, CUDA that a
forked rank cannot initialize, memory another tenant of the device holds. Failing the run for
those would blame the user for the node; they are crashes instead, and the run restarts from
its last checkpoint as it does for a dead node. When in doubt it is the device's: taking a node
fault for the user's costs the run, taking a user's for the node's costs a few retries.
"""

from __future__ import annotations

import torch

# What CUDA, the driver, NVML and their libraries say, lower-cased.
_DEVICE_WORDS = (
    "cuda error",
    "cuda out of memory",
    "cannot re-initialize cuda in forked subprocess",
    "no cuda-capable device",
    "cuda driver",
    "cuda-capable device(s) is/are busy or unavailable",
    "ecc error",
    "nvml",
    "cublas_status",
    "cudnn_status",
    "cusolver_status",
    "device-side assert",
)
# torch's own classes for them (AcceleratorError: a CUDA runtime error, torch 2.8 and later).
_DEVICE_ERRORS: tuple[type[BaseException], ...] = tuple(
    cls for cls in (getattr(torch, "AcceleratorError", None), torch.OutOfMemoryError) if cls
)


def is_device_fault(err: BaseException) -> bool:
    """An error of the device or its driver, by its class or its words."""
    if isinstance(err, _DEVICE_ERRORS):
        return True
    return isinstance(err, RuntimeError) and any(w in str(err).lower() for w in _DEVICE_WORDS)
