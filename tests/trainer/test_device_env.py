"""The CUDA side of a job's environment (trainer.device_env): what a GPU node's ranks need
before their first CUDA call, what the operator may change, and what it may not."""

from __future__ import annotations

from pathlib import Path

from infra.gpu_devices import device_minors
from trainer.device_env import GrantedDevices, device_environment


def test_a_job_gets_the_nvml_check_the_flight_recorder_and_its_own_compile_cache() -> None:
    env = device_environment({}, Path("/n/runs/r/gen-3"), Path("/n/runs/r/compile-cache"))
    assert env["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"  # torchrun's check forks no CUDA state
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_GLOO_LAZY_INIT"] == "1"  # a pair connects at its first exchange
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/n/runs/r/gen-3/nccl-trace-rank-"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/n/runs/r/compile-cache/inductor"
    assert env["TRITON_CACHE_DIR"] == "/n/runs/r/compile-cache/triton"


def test_the_operator_tunes_the_recorder_but_never_shares_a_compile_cache() -> None:
    agent = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "20000",
        "CUDA_DEVICE_ORDER": "FASTEST_FIRST",
        "TORCHINDUCTOR_CACHE_DIR": "/var/cache/every-run",  # code another run could plant
        "TRITON_CACHE_DIR": "/var/cache/every-run-triton",
    }
    env = device_environment(agent, Path("/g"), Path("/run-cache"))
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "20000"
    assert env["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/run-cache/inductor"
    assert env["TRITON_CACHE_DIR"] == "/run-cache/triton"


def test_a_job_is_shown_the_gpus_its_grant_names_counted_in_what_the_agent_was_given() -> None:
    env = device_environment({}, Path("/g"), Path("/c"), GrantedDevices([4, 5, 6, 7], cuda=True))
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert env["FORGELINE_DEVICE"] == "cuda"  # a rank without CUDA there is on a broken node
    # An agent started on a subset of the host's GPUs counts its node's GPUs in that subset.
    agent = {"CUDA_VISIBLE_DEVICES": "2,3,5,7"}
    assert (
        device_environment(agent, Path("/g"), Path("/c"), GrantedDevices([1, 2], cuda=True))[
            "CUDA_VISIBLE_DEVICES"
        ]
        == "3,5"
    )
    assert "CUDA_VISIBLE_DEVICES" not in device_environment({}, Path("/g"), Path("/c"))
    slots = device_environment({}, Path("/g"), Path("/c"), GrantedDevices([0, 1], cuda=False))
    assert "FORGELINE_DEVICE" not in slots  # CPU rank slots: nothing to expect


def test_gpus_named_by_uuid_keep_every_gpu_file_in_the_box() -> None:
    # No mapping from a UUID to a device file here: the variable alone keeps the jobs apart.
    assert device_minors([0], {"CUDA_VISIBLE_DEVICES": "GPU-5f2d0c1e,GPU-77aa"}) is None
