"""Capacity arithmetic for one GPT: parameters, FLOPs per token, bytes of state, memory per GPU.

Pure functions over plain numbers, so a plan for 4,096 GPUs costs nothing to make and needs no
torch. The parameter count is the closed form of trainer/model.py's `GPT` (tests check it against
`sum(p.numel() for p in GPT(cfg).parameters())`); if the model changes, this must change with it.

Units: bytes, FLOPs, seconds. The run-level figures (time, cost, failures, checkpoints) are in
infra/capacity_plan.py; the hardware assumptions in infra/capacity_hardware.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """The network's shape: trainer.model.GPTConfig less dropout and the RoPE base."""

    vocab_size: int
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    rope: bool = False
    swiglu: bool = False
    bias: bool = True  # in every Linear but the tied head, and every LayerNorm


def mlp_hidden(n_embd: int, swiglu: bool) -> int:
    """Hidden width of the MLP: 4·C for GELU; for SwiGLU 8·C/3 rounded up to a multiple of 16.

    SwiGLU has three matrices instead of two, so 2/3 of 4·C keeps the parameter count near GELU's;
    the multiple of 16 keeps the width divisible by every tensor-parallel degree up to 16.
    """
    if not swiglu:
        return 4 * n_embd
    return -(-8 * n_embd // (3 * 16)) * 16  # ceil(8·C / 48) · 16


def block_params(shape: Shape) -> int:
    """One transformer block: two LayerNorms, q/k/v (fused or not, the same count) and proj,
    the MLP; with or without biases."""
    c, hidden = shape.n_embd, mlp_hidden(shape.n_embd, shape.swiglu)
    b = 1 if shape.bias else 0
    norms = 2 * (1 + b) * c  # ln_1, ln_2: gain (and bias)
    attention = 4 * (c * c + b * c)  # q, k, v, proj
    inputs = 2 if shape.swiglu else 1  # fc, and gate for SwiGLU
    mlp = inputs * (c * hidden + b * hidden) + hidden * c + b * c
    return norms + attention + mlp


def param_count(shape: Shape) -> int:
    """Every parameter once: lm_head shares wte's matrix, so the vocabulary counts once."""
    c = shape.n_embd
    positions = 0 if shape.rope else shape.block_size * c  # RoPE has no learned table
    final_norm = (2 if shape.bias else 1) * c
    return shape.vocab_size * c + positions + shape.n_layer * block_params(shape) + final_norm


def stage_params(shape: Shape, pipeline: int) -> float:
    """Parameters of a pipeline stage that holds the embeddings (the first; the last holds a
    tied copy of the table and the final norm): its share of the blocks and the rest."""
    rest = param_count(shape) - shape.n_layer * block_params(shape)
    return shape.n_layer / pipeline * block_params(shape) + rest


@dataclass(frozen=True)
class Pipelining:
    """A pipeline as the planner sees it (trainer/pipeline.py runs it)."""

    ranks: int = 1  # parallel.pipeline
    stages_per_rank: int = 1
    microbatches: int = 1
    schedule: str = "1F1B"  # 1F1B, interleaved-1F1B or zero-bubble

    def bubble(self) -> float:
        """The share of a step the pipeline idles (Narayanan et al. 2021): (P − 1)/(v·M + P − 1)
        for P ranks of v stages over M micro-batches; zero-bubble (Qi et al. 2023, ZB-H1)
        fills two thirds of it with the weights' half of the backward."""
        p, v, m = self.ranks, self.stages_per_rank, self.microbatches
        if p == 1:
            return 0.0
        idle = (p - 1) / (v * m + p - 1)
        return idle / 3 if self.schedule == "zero-bubble" else idle

    def in_flight(self) -> float:
        """Micro-batches whose activations the first rank holds at once, each for its share
        of the layers: 1F1B (and zero-bubble) fill the pipeline with P before the first
        backward; interleaving holds (1 + (P − 1)/(P·v)) times that (Narayanan et al.)."""
        p, v = self.ranks, self.stages_per_rank
        if p == 1:
            return 1.0
        held = float(min(p, self.microbatches))
        return held * (1 + (p - 1) / (p * v)) if self.schedule == "interleaved-1F1B" else held


def non_embedding_params(shape: Shape) -> int:
    """As GPT.num_params(): less the position table; the tied wte stays (it is the lm_head)."""
    return param_count(shape) - (0 if shape.rope else shape.block_size * shape.n_embd)


def palm_flops_per_token(non_embedding: int, n_layer: int, n_embd: int, block_size: int) -> float:
    """PaLM (Chowdhery et al., appendix B): 6N for the matmuls forward and backward, plus
    12·L·H·Q·T for attention scores (H·Q = n_embd); trainer/metrics.py reports MFU with it."""
    return 6 * non_embedding + 12 * n_layer * n_embd * block_size


def flops_per_token(shape: Shape) -> float:
    return palm_flops_per_token(
        non_embedding_params(shape), shape.n_layer, shape.n_embd, shape.block_size
    )


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each piece of training state (AdamW: two moments)."""

    name: str
    weights: int
    grads: int
    master: int  # an fp32 copy the optimizer updates, when the weights are 16-bit
    moments: int

    @property
    def per_param(self) -> int:
        return self.weights + self.grads + self.master + self.moments

    @property
    def checkpoint_per_param(self) -> int:
        """What a save keeps: the authoritative weights (the master copy if any) and moments."""
        return (self.master or self.weights) + self.moments


# ZeRO (Rajbhandari et al., 2020) counts mixed precision as 2 + 2 + 12 = 16 bytes a parameter.
# Pure bf16 keeps AdamW's moments in the weights' dtype, as torch.optim.AdamW does.
PRECISIONS = {
    p.name: p
    for p in (
        Precision("bf16-mixed", weights=2, grads=2, master=4, moments=8),
        Precision("fp32", weights=4, grads=4, master=0, moments=8),
        Precision("bf16", weights=2, grads=2, master=0, moments=4),
    )
}


def model_state_bytes(params: int, precision: Precision) -> int:
    return params * precision.per_param


@dataclass(frozen=True)
class Memory:
    """Bytes one GPU holds at the peak of a step (an estimate: see activation_bytes)."""

    weights: float
    grads: float
    master: float
    moments: float
    gathered: float  # FSDP's all-gathered blocks: whole weights and grads of one block or two
    activations: float
    logits: float

    @property
    def total(self) -> float:
        return sum(self.parts().values())

    def parts(self) -> dict[str, float]:
        return {
            "weights": self.weights,
            "gradients": self.grads,
            "master weights": self.master,
            "optimizer moments": self.moments,
            "FSDP gathered blocks": self.gathered,
            "activations": self.activations,
            "logits": self.logits,
        }

    def dominant(self) -> tuple[str, float]:
        """The biggest of the three things a layout trades: state, activations, gathers."""
        groups = {
            "training state": self.weights + self.grads + self.master + self.moments,
            "activations": self.activations + self.logits,
            "FSDP gathered blocks": self.gathered,
        }
        return max(groups.items(), key=lambda item: item[1])


def activation_bytes(
    shape: Shape, micro_batch: int, tensor: int, flash: bool, recompute: str = "none"
) -> float:
    """Activations kept for backward, all layers, 16-bit.

    Korthikanti et al. (2022), tensor parallel without sequence parallelism: per layer
    s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes. The last term is the attention score matrices, which a
    fused (flash) attention kernel never stores; torch's SDPA uses one on GPUs, so `flash` drops it.

    With activation recomputation (`trainer.activation_recompute`):
    - "full": each layer keeps its input (2·s·b·h) and one layer's whole set lives again while it
      is recomputed;
    - "selective": each layer keeps its input and the outputs of its products and attention,
      2 + 6/t (qkv) + 2/t (attention) + 2 (its projection) + 8/t (the MLP's first product) + 2
      (its projection) = 6 + 16/t per token, and the score products (2·a·s/(h·t)) where no
      fused kernel runs; norms, activation functions and dropout are computed again.
    """
    s, b, h, a, t = shape.block_size, micro_batch, shape.n_embd, shape.n_head, tensor
    per_token = 10 + 24 / t + (0 if flash else 5 * a * s / (h * t))
    layer = s * b * h * per_token
    if recompute == "full":
        return shape.n_layer * 2 * s * b * h + layer
    if recompute == "selective":
        kept = 6 + 16 / t + (0 if flash else 2 * a * s / (h * t))
        return shape.n_layer * s * b * h * kept
    return shape.n_layer * layer


# The forward's share of a step's FLOPs (2 of 6 per parameter and token): what full
# recomputation runs again. Selective recomputes no product: its extra FLOPs are negligible.
RECOMPUTE_FLOPS = {"none": 1.0, "selective": 1.0, "full": 8 / 6}


def logits_bytes(shape: Shape, micro_batch: int, tensor: int) -> float:
    """The output layer's logits in fp32 for the loss: 4·s·b·V (Korthikanti et al.), split by t."""
    return 4 * shape.block_size * micro_batch * shape.vocab_size / tensor


def memory_per_gpu(
    shape: Shape,
    precision: Precision,
    shard: int,
    tensor: int,
    micro_batch: int,
    flash: bool,
    recompute: str = "none",
    pipeline: Pipelining | None = None,
) -> Memory:
    """Replicas hold all the state; FSDP divides it by the shard degree, tensor parallelism by
    the tensor degree (the few replicated LayerNorm gains are counted as split too), a
    pipeline by its stages (the first, which holds the embeddings, is the one counted).
    `micro_batch`: the sequences of one forward (under a pipeline, one of its micro-batches),
    whose activations a pipeline's first rank holds `pipeline.in_flight()` of at once, each
    for its share of the layers."""
    pipeline = pipeline or Pipelining()
    params = stage_params(shape, pipeline.ranks) / (shard * tensor)
    # FSDP2 gathers a block's weights before use and prefetches the next one; the block's
    # gradients exist unsharded until their reduce-scatter.
    block = block_params(shape) / tensor
    gathered = block * (2 * precision.weights + precision.grads) if shard > 1 else 0.0
    return Memory(
        weights=params * precision.weights,
        grads=params * precision.grads,
        master=params * precision.master,
        moments=params * precision.moments,
        gathered=gathered,
        activations=activation_bytes(shape, micro_batch, tensor, flash, recompute)
        * pipeline.in_flight()
        / pipeline.ranks,
        logits=logits_bytes(shape, micro_batch, tensor),
    )
