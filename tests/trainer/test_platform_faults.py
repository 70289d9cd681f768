"""Errors of a GPU node's device or driver, as torch raises them before a script's first step,
are the node's (trainer.platform_faults): the run restarts instead of failing as the user's
mistake, and those that say the node is broken take it out of service. The real-rank half is
in test_user_code.py."""

from __future__ import annotations

import pytest
import torch

from trainer.platform_faults import is_broken_node, is_device_fault, is_fabric_fault

NODE_S = [
    torch.AcceleratorError("CUDA error: uncorrectable ECC error encountered"),
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("Cannot re-initialize CUDA in forked subprocess. To use CUDA with "
                 "multiprocessing, you must use the 'spawn' start method"),
    RuntimeError("Found no NVIDIA driver on your system."
                 " ... no CUDA-capable device is detected"),
    RuntimeError("The NVIDIA driver on your system is too old (found version 11040). "
                 "CUDA driver version is insufficient for CUDA runtime version"),
    RuntimeError("CUDA error: CUDA-capable device(s) is/are busy or unavailable"),
    RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, ...)`"),
    RuntimeError("NVML_SUCCESS == r INTERNAL ASSERT FAILED at CUDACachingAllocator.cpp"),
]  # fmt: skip
USER_S = [
    NameError("name 'modle' is not defined"),
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x10 and 20x3)"),
    ValueError("learning rate must be positive"),
    RuntimeError("Expected all tensors to be on the same device, but found cpu and meta"),
]


@pytest.mark.parametrize("err", NODE_S, ids=lambda e: str(e)[:30])
def test_a_device_or_driver_error_is_the_node_s(err: BaseException) -> None:
    assert is_device_fault(err)


@pytest.mark.parametrize("err", USER_S, ids=lambda e: str(e)[:30])
def test_a_script_s_own_error_stays_the_user_s(err: BaseException) -> None:
    assert not is_device_fault(err) and not is_fabric_fault(err) and not is_broken_node(err)


# What says the hardware or the driver is broken, whoever's code ran: the node goes out of
# service. The rest of NODE_S may be the script's as much (its memory, its kernels' asserts)
# or the platform's launch (a forked rank), and the node stays.
BROKEN = {0, 3, 4, 5, 7}


@pytest.mark.parametrize("at", range(len(NODE_S)), ids=lambda at: str(NODE_S[at])[:30])
def test_only_errors_of_broken_hardware_or_driver_take_the_node_out(at: int) -> None:
    assert is_broken_node(NODE_S[at]) == (at in BROKEN)


def test_a_peer_gone_from_a_collective_is_the_fabric_s() -> None:
    assert is_fabric_fault(
        RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    )
    assert not is_broken_node(RuntimeError("NCCL communicator was aborted: peer gone"))
