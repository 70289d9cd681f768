"""The run spec: what a user submits, validated in full before anything starts.

Every model forbids unknown keys, so a typo (`step = 100` for `steps`) is an error that names the
field instead of a silently ignored setting.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

# Names become workflow ids, store keys and MLflow model names: keep them path- and URL-safe.
NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
NAME_RULE = "1-63 characters from a-z, 0-9, '.', '_', '-', starting with a letter or digit"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DataSpec(_Strict):
    sources: list[str] = Field(min_length=1, description="text files; relative to the spec file")
    split: Literal["blank-line", "line", "whole-file"] = "blank-line"
    tokenizer: Literal["char", "byte"] = "char"
    val_fraction: float = Field(0.1, gt=0.0, lt=0.5)
    shard_tokens: int = Field(1 << 20, ge=1024, le=1 << 30)


class ModelSpec(_Strict):
    n_layer: int = Field(4, ge=1, le=128)
    n_head: int = Field(4, ge=1, le=128)
    n_embd: int = Field(128, ge=8, le=16384)
    block_size: int = Field(128, ge=8, le=32768)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelSpec:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        return self


class TrainSpec(_Strict):
    steps: int = Field(200, ge=1, le=10_000_000)
    batch_size: int = Field(32, ge=1, le=1 << 20, description="sequences per step, all ranks")
    learning_rate: float = Field(1e-3, gt=0.0, le=1.0)
    min_lr: float = Field(1e-4, ge=0.0, le=1.0)
    warmup_steps: int = Field(20, ge=0)
    weight_decay: float = Field(0.1, ge=0.0, le=1.0)
    grad_clip: float = Field(1.0, ge=0.0)
    seed: int = Field(1337, ge=0, lt=2**31)
    log_every: int = Field(10, ge=1)
    checkpoint_every: int = Field(50, ge=1)
    keep_checkpoints: int = Field(2, ge=1, le=100)
    eval_batches: int = Field(20, ge=1, le=10_000)
    threads_per_rank: int = Field(1, ge=1, le=256, description="CPU threads per rank")
    peak_flops_per_gpu: float = Field(
        1e11, gt=0, description="the device's peak FLOP/s used for MFU (CPU core here)"
    )

    @model_validator(mode="after")
    def _schedule_fits(self) -> TrainSpec:
        if self.min_lr > self.learning_rate:
            raise ValueError(
                f"min_lr ({self.min_lr}) must not exceed learning_rate ({self.learning_rate})"
            )
        return self


class ResourcesSpec(_Strict):
    nodes: int = Field(1, ge=1, le=4096)
    gpus_per_node: int = Field(1, ge=1, le=64)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


class RecoverySpec(_Strict):
    max_restarts: int = Field(3, ge=0, le=100)
    heartbeat_timeout_s: int = Field(15, ge=2, le=3600)


class RegistrySpec(_Strict):
    model_name: Name | None = None
    sample_prompt: str = Field("\n", max_length=1000)
    sample_tokens: int = Field(200, ge=1, le=4096)


class RunSpec(_Strict):
    name: Name
    owner: Name = "anonymous"
    data: DataSpec
    model: ModelSpec = ModelSpec()
    train: TrainSpec = TrainSpec()
    resources: ResourcesSpec = ResourcesSpec()
    recovery: RecoverySpec = RecoverySpec()
    registry: RegistrySpec = RegistrySpec()

    @property
    def model_name(self) -> str:
        return self.registry.model_name or self.name

    @model_validator(mode="after")
    def _batch_splits_over_ranks(self) -> RunSpec:
        world = self.resources.world_size
        if self.train.batch_size % world:
            raise ValueError(
                f"train.batch_size ({self.train.batch_size}) must be a multiple of the world "
                f"size resources.nodes × resources.gpus_per_node = {world}"
            )
        return self
