"""Errors of a GPU node's device or driver, as torch raises them before a script's first step,
are the node's (trainer.device_faults): the run restarts instead of failing as the user's
mistake. The real-rank half is in test_user_code.py."""

from __future__ import annotations

import pytest
import torch

from trainer.device_faults import is_device_fault

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
    assert not is_device_fault(err)
