"""What each device type trains with (trainer.parallel.precision_for): bf16 FSDP all-gathers,
fp32 reduce-scatters and the fused AdamW on GPUs; nothing changed on CPU. The choice is a
function of the device type alone, so the GPU's answer is checked here without a GPU."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from trainer.model import GPT, GPTConfig
from trainer.parallel import precision_for


def test_gpus_gather_in_bf16_reduce_in_fp32_and_fuse_adamw() -> None:
    precision = precision_for("cuda")
    assert precision.fsdp.param_dtype == torch.bfloat16
    assert precision.fsdp.reduce_dtype == torch.float32
    assert precision.fused_adamw is True


def test_cpu_keeps_fsdp_s_default_policy_and_torch_s_default_adamw() -> None:
    precision = precision_for("cpu")
    assert precision.fsdp == MixedPrecisionPolicy()  # no casts: what fully_shard did before
    assert precision.fused_adamw is None


def test_the_model_s_optimizer_takes_the_choice() -> None:
    model = GPT(GPTConfig(vocab_size=32, n_layer=1, n_head=2, n_embd=16, block_size=8))
    for device_type in ("cuda", "cpu"):
        optimizer = model.optimizer(1e-3, 0.1, fused=precision_for(device_type).fused_adamw)
        assert optimizer.defaults["fused"] is precision_for(device_type).fused_adamw
