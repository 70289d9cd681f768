"""A GPT-2 style decoder-only transformer, small enough to read in one sitting.

Optional modern pieces: rotary position embedding (RoPE) instead of learned positions, and a
SwiGLU MLP instead of GELU. Layers are laid out for Megatron-style tensor parallelism: attention
qkv and MLP fc/gate are column-parallel (a rank holds a slice of their output rows), and both
`proj` layers are row-parallel (a rank holds the matching slice of input columns, and the ranks'
outputs are summed). Forward passes therefore never assume they see all heads or all hidden units.

q, k and v come from one fused matrix whose output rows are grouped by head (head 0's q, k, v,
then head 1's, ...), so a column shard of whole heads holds their q, k and v together; and no
Linear or LayerNorm has a bias (nanoGPT's `bias=False`). Both are faster at small widths (one
matmul instead of three, fewer kernels). Checkpoints made before hold separate q, k, v with
biases: `fused_qkv=False, bias=True`, what a config without those keys means, still loads them.

Shapes: B batch, T time (≤ block_size), C channels (n_embd), H heads, D head dim (C/H),
V vocabulary. Under tensor parallelism of degree tp a rank sees H/tp heads, C/tp attention width.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F

from infra.capacity import mlp_hidden


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 128
    dropout: float = 0.0
    rope: bool = False  # rotary positions in attention instead of the learned `wpe` table
    swiglu: bool = False  # SwiGLU MLP instead of GELU
    rope_theta: float = 10000.0  # RoPE base: pair i turns by position · theta^(-2i/D)
    # The defaults are the layout of configs stored before these keys existed (checkpoint
    # manifests, registered versions); the spec gives new runs fused_qkv=True, bias=False.
    fused_qkv: bool = False  # one qkv matrix, rows grouped by head, instead of q, k and v
    bias: bool = True  # biases in every Linear (but the tied head) and LayerNorm

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                "change n_embd or n_head so every head gets the same width"
            )
        if self.rope and (self.n_embd // self.n_head) % 2:
            raise ValueError(
                f"rope needs an even head dim, but n_embd / n_head = {self.n_embd // self.n_head}; "
                "choose n_embd and n_head with an even ratio, or set rope=False"
            )

    def to_dict(self) -> dict:
        return asdict(self)


WEIGHT_LAYOUT = ("fused_qkv", "bias")


def stored_layout(model_config: dict) -> dict[str, bool]:
    """How a stored config's weights are laid out: a config written before these keys existed
    means separate q, k, v with biases (GPTConfig's defaults)."""
    fields = GPTConfig.__dataclass_fields__
    return {key: bool(model_config.get(key, fields[key].default)) for key in WEIGHT_LAYOUT}


def laid_out_as(shape: dict, stored: dict | None) -> dict:
    """The built-in GPT's shape for a run (`shape`: the spec's), laid out as the weights it
    starts from (`stored`: their checkpoint's model_config) when it starts from any: a run
    begun, or a base model trained, before the fused layout keeps the layout it has."""
    return {**shape, **stored_layout(stored)} if stored else dict(shape)


def rotary_tables(head_dim: int, n_pos: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (n_pos, D); angle(p, i) = p · theta^(-2i/D).

    Rotate-half layout (GPT-NeoX, Llama): channel i is paired with channel i + D/2, so each
    frequency appears twice, once for each half.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # (D/2,)
    angles = torch.outer(torch.arange(n_pos, dtype=torch.float32), inv_freq)  # (n_pos, D/2)
    angles = torch.cat((angles, angles), dim=-1)  # (n_pos, D)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (x_i, x_{i+D/2}) pair of x (..., T, D) by the angles in cos/sin (T, D).

    A query at position m and a key at position n then have a dot product that depends only on
    m - n: rotations compose, R(m)ᵀR(n) = R(n - m).
    """
    x1, x2 = x.chunk(2, dim=-1)  # 2 × (..., T, D/2)
    rotated = torch.cat((-x2, x1), dim=-1)  # (..., T, D)
    # Cast the float32 tables to x's dtype so bf16/autocast runs stay in one dtype.
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding (Su et al., 2021) for tensors of shape (B, H, T, D).

    The same rotation is applied in every head, so it works for any number of local heads.
    """

    def __init__(self, head_dim: int, block_size: int, theta: float) -> None:
        super().__init__()
        self.table_args = (head_dim, block_size, theta)
        cos, sin = rotary_tables(*self.table_args)
        # Non-persistent: recomputed on construction, so checkpoints carry no rope tensors and
        # have the same keys whatever the layout.
        self.register_buffer("cos", cos, persistent=False)  # (block_size, D)
        self.register_buffer("sin", sin, persistent=False)  # (block_size, D)

    @torch.no_grad()
    def reset_tables(self) -> None:
        """Compute the tables again into the buffers, wherever they are: a model built on the
        meta device has none to copy when it is given storage (`to_empty`)."""
        cos, sin = rotary_tables(*self.table_args)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.size(-2)
        return apply_rotary(x, self.cos[:T], self.sin[:T])


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        c, bias = config.n_embd, config.bias
        if config.fused_qkv:  # output rows (H, 3, D): a shard of whole heads has all three
            self.qkv: nn.Linear | None = nn.Linear(c, 3 * c, bias=bias)
        else:  # the layout of older checkpoints: each column-sharded by heads on its own
            self.qkv = None
            self.q, self.k, self.v = (nn.Linear(c, c, bias=bias) for _ in range(3))
        self.proj = nn.Linear(c, c, bias=bias)
        self.rotary = (
            Rotary(self.head_dim, config.block_size, config.rope_theta) if config.rope else None
        )
        self.dropout = config.dropout
        # Where dropout on this module's heads draws from. Split by heads across a
        # tensor-parallel group, each rank's own stream (trainer.parallel sets
        # trainer.rng_streams.sharded_draws; this file ships with registered models alone).
        self.head_draws: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, C') -> (B, T, H', D) -> (B, H', T, D), where C' = H'·D is this rank's width.
        # Reshape by head_dim with -1 heads (never by n_head or C): under tensor parallelism the
        # sharded q/k/v produce only C/tp channels, i.e. H/tp heads.
        if self.qkv is not None:
            # (B, T, 3C') -> (B, T, H', 3, D): q, k, v of each head side by side.
            q, k, v = self.qkv(x).view(B, T, -1, 3, self.head_dim).transpose(1, 2).unbind(3)
        else:
            q, k, v = (
                lin(x).view(B, T, -1, self.head_dim).transpose(1, 2)
                for lin in (self.q, self.k, self.v)
            )
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        dropout = self.dropout if self.training else 0.0
        with self.head_draws() if dropout else contextlib.nullcontext():
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        # (B, H', T, D)
        # (B, H', T, D) -> (B, T, C'); the row-sharded proj takes C' inputs.
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = mlp_hidden(config.n_embd, config.swiglu)
        bias = config.bias
        self.fc = nn.Linear(config.n_embd, hidden, bias=bias)
        self.gate = nn.Linear(config.n_embd, hidden, bias=bias) if config.swiglu else None
        self.proj = nn.Linear(hidden, config.n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fc and gate are elementwise-combined per hidden unit, so both shard by the same rows.
        if self.gate is None:
            return self.proj(F.gelu(self.fc(x)))
        return self.proj(F.silu(self.gate(x)) * self.fc(x))  # SwiGLU (Shazeer, 2020)


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.mlp(self.ln_2(x)))


def adamw(
    model: nn.Module, learning_rate: float, weight_decay: float, fused: bool | None = None
) -> torch.optim.AdamW:
    """The GPT's AdamW over `model`'s parameters (the whole model's, or a pipeline stage's)."""
    # Decay matrices only: biases and norm gains have no scale to regularise.
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=learning_rate,
        betas=(0.9, 0.95),
        fused=fused,
    )


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        # RoPE encodes position inside attention, so there is no learned position table.
        self.wpe = None if config.rope else nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.tie_weights()
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled by 1/sqrt(2·n_layer) so the stream's variance
        # does not grow with depth.
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def tie_weights(self) -> None:
        """The head reads out through the embedding's matrix (tied embeddings). Called again
        after `to_empty`, which gives each module a parameter of its own."""
        self.lm_head.weight = self.wte.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _B, T = idx.shape
        if self.config.block_size < T:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        x = self.wte(idx)  # (B, T, C)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=idx.device))
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters, counting the tied embedding once; positions excluded when non_embedding."""
        total = sum(p.numel() for p in self.parameters())
        if non_embedding and self.wpe is not None:
            total -= self.wpe.weight.numel()
        return total

    def optimizer(
        self, learning_rate: float, weight_decay: float, fused: bool | None = None
    ) -> torch.optim.AdamW:
        """AdamW; `fused` as torch takes it (trainer.parallel.precision_for chooses: the fused
        kernel on GPUs, torch's default elsewhere)."""
        return adamw(self, learning_rate, weight_decay, fused)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.8,
        top_k: int | None = 50,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append `max_new_tokens` sampled tokens to idx (B, T)."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]
            logits, _ = self(context)
            logits = logits[:, -1, :] / max(temperature, 1e-6)  # (B, V)
            if top_k is not None:
                # A slice, not a list index: no index tensor made on the host for a GPU's logits.
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx
