"""The run spec: what a user submits, validated in full before anything starts.

Every model forbids unknown keys, so a typo (`step = 100` for `steps`) is an error that names the
field instead of a silently ignored setting. Every number is bounded and finite and every string
has a length limit: the spec travels in workflow histories as JSON (where inf would become null
and a run could not read its own input back) and must stay far under Temporal's 2 MB payloads.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    StringConstraints,
    field_validator,
    model_validator,
)

# Names become workflow ids, store keys and MLflow model names: keep them path- and URL-safe
# (the rule lives in workflows.contracts.names; re-exported here for the models that use it).
from workflows.contracts.names import NAME_PATTERN, NAME_RULE, reserved_id

__all__ = ["NAME_PATTERN", "NAME_RULE", "RunSpec"]

Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
_NAME = NAME_PATTERN.strip("^$")
INIT_FROM = re.compile(
    rf"^(models:/{_NAME}(/[1-9][0-9]{{0,8}}|@{_NAME})|runs/{_NAME}/checkpoints/step-[0-9]+/(gen-[0-9]+/)?MANIFEST\.json)$"
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# A rank script: a .py path inside train.code (no part may start with '.': no `..`, no
# hidden folders); or an importable function.
ENTRY_SCRIPT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*\.py")
ENTRY_FUNCTION = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
MAX_ARGS_BYTES = 64 * 1024  # train.args travels in every history of the run
# In train.argv: the path of the script's checkpoint folder on its node.
CHECKPOINT_DIR = "{checkpoint_dir}"
_Arg = Annotated[str, StringConstraints(max_length=1000)]
# An image reference as podman takes it: [registry[:port]/]name[:tag][@sha256:digest].
IMAGE_REFERENCE = (
    r"^[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-]+[a-z0-9]+)*)*"
    r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[0-9a-f]{64})?$"
)


def _inside_the_folder(glob: str) -> str:
    if glob.startswith("/") or ".." in glob.split("/"):
        raise ValueError(f"{glob!r} is not inside the checkpoint folder: name it relative to it")
    return glob


# A glob inside a script's checkpoint folder: relative, never climbing out of it.
_FolderGlob = Annotated[
    str, StringConstraints(min_length=1, max_length=300), AfterValidator(_inside_the_folder)
]

# Counts of steps (and step intervals): a year of 3-second steps is ~10 M.
MAX_STEPS = 10_000_000
# A document longer than this cannot reach a filter: readers skip records over 64 MiB.
MAX_DOC_CHARS = 1 << 30
MAX_SOURCES = 128  # more files: name their folder or a glob
MAX_PATH_CHARS = 4096  # PATH_MAX on Linux


def _no_nul(path: str) -> str:
    if "\x00" in path:
        raise ValueError("a path cannot contain a NUL character")
    return path


SourcePath = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_PATH_CHARS), AfterValidator(_no_nul)
]


NgramBound = tuple[Annotated[int, Field(ge=1, le=100)], Annotated[float, Field(ge=0.0, le=1.0)]]


class FilterSpec(_Strict):
    """Quality filters (names and defaults as dataprep.filters.FilterSettings: Gopher's)."""

    min_chars: int = Field(1, ge=0, le=MAX_DOC_CHARS)
    max_chars: int = Field(1_000_000, ge=1, le=MAX_DOC_CHARS)
    gopher: bool = True
    min_words: int = Field(50, ge=0, le=MAX_DOC_CHARS)
    max_words: int = Field(100_000, ge=1, le=MAX_DOC_CHARS)
    min_mean_word_length: float = Field(3.0, ge=0)
    max_mean_word_length: float = Field(10.0, ge=0)
    max_symbol_word_ratio: float = Field(0.1, ge=0)
    max_ellipsis_line_fraction: float = Field(0.3, ge=0, le=1)
    max_bullet_line_fraction: float = Field(0.9, ge=0, le=1)
    min_alpha_word_fraction: float = Field(0.8, ge=0, le=1)
    repetition: bool = True
    max_duplicate_line_fraction: float = Field(0.3, ge=0, le=1)
    max_duplicate_line_char_fraction: float = Field(0.2, ge=0, le=1)
    max_top_ngram_char_fraction: tuple[NgramBound, ...] = ((2, 0.20), (3, 0.18), (4, 0.16))
    max_duplicate_ngram_char_fraction: tuple[NgramBound, ...] = (
        (5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12), (9, 0.11), (10, 0.10),
    )  # fmt: skip

    @model_validator(mode="after")
    def _bounds_ordered(self) -> FilterSpec:
        for low, high in (
            ("min_chars", "max_chars"),
            ("min_words", "max_words"),
            ("min_mean_word_length", "max_mean_word_length"),
        ):
            if getattr(self, low) > getattr(self, high):
                raise ValueError(
                    f"{low} ({getattr(self, low)}) exceeds {high} ({getattr(self, high)})"
                )
        return self


MEMORY_PATTERN = r"^\d+(\.\d+)? ?(KB|MB|GB|TB|KiB|MiB|GiB|TiB)$"
_UNITS = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KiB": 2**10, "MiB": 2**20,
          "GiB": 2**30, "TiB": 2**40}  # fmt: skip
MIN_MEMORY, MAX_MEMORY = 32e6, 1024e12


def memory_bytes(size: str) -> float:
    """Bytes of a size that matches MEMORY_PATTERN ('512MB', '1.5 GiB')."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?) ?([KMGT]i?B)", size)
    assert match is not None, size
    return float(match[1]) * _UNITS[match[2]]


class DedupSpec(_Strict):
    exact: bool = True
    near: bool = True
    ngram: int = Field(5, ge=1, le=64, description="words per shingle")
    bands: int = Field(14, ge=1, le=1024)
    rows: int = Field(8, ge=1, le=64)
    verify: bool = Field(False, description="check candidates' exact Jaccard ≥ threshold")
    threshold: float = Field(0.8, gt=0.0, le=1.0)
    memory_limit: str = Field("1GB", pattern=MEMORY_PATTERN)

    @field_validator("memory_limit")
    @classmethod
    def _memory_in_range(cls, value: str) -> str:
        # DuckDB refuses these only when the dedup stage starts, after every chunk was scanned.
        size = memory_bytes(value)
        if not MIN_MEMORY <= size <= MAX_MEMORY:
            raise ValueError(f"{value!r} is outside what DuckDB can work in: use 32MB to 1024TB")
        return value


class DataSpec(_Strict):
    sources: list[SourcePath] = Field(
        min_length=1,
        max_length=MAX_SOURCES,
        description="files, directories or globs (relative to the spec file), s3://bucket/… "
        "URLs or store:KEY objects of the run's store",
    )
    split: Literal["blank-line", "line", "whole-file"] = "blank-line"
    text_field: str = Field(
        "text", min_length=1, max_length=256, description="JSONL / Parquet text column"
    )
    max_bad_fraction: float = Field(0.01, ge=0.0, le=1.0)
    tokenizer: Literal["char", "byte", "bpe"] = "char"
    vocab_size: int = Field(8192, ge=257, le=1 << 20, description="for bpe")
    tokenizer_train_mb: int = Field(200, ge=1, le=1 << 20, description="bpe training text")
    val_fraction: float = Field(0.1, gt=0.0, lt=0.5)
    shard_tokens: int = Field(1 << 20, ge=1024, le=1 << 30)
    chunk_mb: int = Field(64, ge=1, le=1 << 16, description="unit of parallel work")
    filters: FilterSpec = FilterSpec()
    dedup: DedupSpec = DedupSpec()


class ModelSpec(_Strict):
    n_layer: int = Field(4, ge=1, le=128)
    n_head: int = Field(4, ge=1, le=128)
    n_embd: int = Field(128, ge=8, le=16384)
    block_size: int = Field(128, ge=8, le=32768)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    rope: bool = Field(False, description="rotary position embedding instead of learned positions")
    swiglu: bool = Field(False, description="SwiGLU MLP instead of GELU")
    rope_theta: float = Field(10000.0, gt=0)
    fused_qkv: bool = Field(True, description="one qkv matrix (rows by head) instead of three")
    bias: bool = Field(False, description="biases in every Linear and LayerNorm (GPT-2's)")
    init_from: str | None = Field(
        None,
        max_length=300,
        description="fine-tune from a registered model (models:/NAME/VERSION or "
        "models:/NAME@ALIAS) or a checkpoint manifest key "
        "(runs/RUN/checkpoints/step-N/gen-G/MANIFEST.json)",
    )

    @field_validator("init_from")
    @classmethod
    def _init_from_form(cls, value: str | None) -> str | None:
        # fullmatch: with match, '$' would also accept a trailing newline.
        if value is not None and not INIT_FROM.fullmatch(value):
            raise ValueError(
                f"init_from {value!r} is neither models:/NAME/VERSION, models:/NAME@ALIAS "
                "nor runs/RUN/checkpoints/step-N/gen-G/MANIFEST.json"
            )
        return value

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelSpec:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if self.rope and (self.n_embd // self.n_head) % 2:
            raise ValueError(
                f"rope needs an even head size; n_embd / n_head = {self.n_embd // self.n_head}"
            )
        return self

    def architecture(self) -> dict:
        """The fields that shape the network (trainer.model.GPTConfig, less the vocabulary)."""
        return self.model_dump(exclude={"init_from"})


class TrainSpec(_Strict):
    steps: int = Field(200, ge=1, le=MAX_STEPS)
    batch_size: int = Field(32, ge=1, le=1 << 20, description="sequences per step, all ranks")
    learning_rate: float = Field(1e-3, gt=0.0, le=1.0)
    min_lr: float = Field(1e-4, ge=0.0, le=1.0)
    warmup_steps: int = Field(20, ge=0, le=MAX_STEPS)
    weight_decay: float = Field(0.1, ge=0.0, le=1.0)
    grad_clip: float = Field(1.0, ge=0.0)
    seed: int = Field(1337, ge=0, lt=2**31)
    log_every: int = Field(10, ge=1, le=MAX_STEPS)
    checkpoint_every: Annotated[int, Field(ge=1, le=MAX_STEPS)] | Literal["auto"] = Field(
        50, description='steps between checkpoints, or "auto" (Young/Daly from measured cost)'
    )
    checkpoint_every_minutes: float | None = Field(
        None, gt=0, le=60 * 24 * 365, description="also by time"
    )
    checkpoint_each_epoch: bool = Field(False, description="also when an epoch ends")
    keep_checkpoints: int = Field(2, ge=1, le=100)
    peer_every: int = Field(
        0,
        ge=0,
        le=MAX_STEPS,
        description="steps between peer-tier checkpoints (node-local disk and one peer node, "
        "nothing to the store): a failure loses at most this many steps; 0: none",
    )
    eval_batches: int = Field(20, ge=1, le=10_000)
    threads_per_rank: int = Field(1, ge=1, le=256, description="CPU threads per rank")
    peak_flops_per_gpu: float | None = Field(
        None,
        gt=0,
        description="the device's peak FLOP/s for MFU; unset: what the node agents report "
        "(the data sheet's for a known GPU, else measured when the agent starts)",
    )
    grad_accum_steps: int = Field(1, ge=1, le=4096, description="micro-batches per step and rank")
    eval_every: int = Field(
        0, ge=0, le=MAX_STEPS, description="validation loss every N steps; 0: at the end"
    )
    async_checkpoint: bool = Field(True, description="save in the background (False: blocking)")
    collective_timeout_s: int = Field(
        300, ge=10, le=86_400, description="a stuck collective fails the ranks after this long"
    )
    # Your own training code (the SDK, `import forgeline`); unset: the built-in GPT trainer.
    code: SourcePath | None = Field(
        None, description="the folder of your training code; relative to the spec file"
    )
    entrypoint: str | None = Field(
        None,
        max_length=300,
        description='your rank script in train.code ("train.py") or "module:function"',
    )
    args: dict[Annotated[str, StringConstraints(min_length=1, max_length=100)], JsonValue] = Field(
        {}, max_length=256, description="handed to your script as it is (forgeline run.args)"
    )
    # A script as it is (it never imports forgeline): it saves where FORGELINE_CHECKPOINT_DIR
    # says (or the argument that names {checkpoint_dir}), and Forgeline commits that folder.
    checkpoints: Literal["sdk", "folder"] = Field(
        "sdk",
        description='"sdk": run.restore() saves and restores; "folder": your script saves into '
        "its checkpoint folder, which Forgeline commits and restores for the next gang",
    )
    argv: list[_Arg] = Field(
        [], max_length=256, description=f"your script's arguments; {CHECKPOINT_DIR} is its folder"
    )
    resume_argv: list[_Arg] = Field(
        [], max_length=64, description="added after argv when the folder holds a checkpoint"
    )

    image: str | None = Field(
        None,
        max_length=255,
        pattern=IMAGE_REFERENCE,
        description="a container image the ranks run in (podman on the nodes), in place of "
        "train.code's requirements: its python3 (the nodes' minor version) and torch run them",
    )

    @model_validator(mode="after")
    def _schedule_fits(self) -> TrainSpec:
        if self.min_lr > self.learning_rate:
            raise ValueError(
                f"min_lr ({self.min_lr}) must not exceed learning_rate ({self.learning_rate})"
            )
        every = self.checkpoint_every
        if self.peer_every and isinstance(every, int) and self.peer_every >= every:
            raise ValueError(
                f"peer_every ({self.peer_every}) must be below checkpoint_every ({every}): the "
                "peer tier is the cheap checkpoint between the store's (or set peer_every = 0)"
            )
        return self

    @model_validator(mode="after")
    def _user_code_named(self) -> TrainSpec:
        if (self.code is None) != (self.entrypoint is None):
            raise ValueError(
                "train.code and train.entrypoint go together: set both (code: the folder, "
                'entrypoint: the script in it, "train.py", or "module:function"), or neither'
            )
        if self.entrypoint is not None and not (
            ENTRY_SCRIPT.fullmatch(self.entrypoint) or ENTRY_FUNCTION.fullmatch(self.entrypoint)
        ):
            raise ValueError(
                f"train.entrypoint {self.entrypoint!r} is neither a .py file inside train.code "
                '(such as "train.py" or "src/train.py") nor "module:function"'
            )
        if self.entrypoint is None and (self.argv or self.resume_argv or self.checkpoints != "sdk"):
            raise ValueError(
                "train.argv, train.resume_argv and train.checkpoints are for your own script: "
                "set train.code and train.entrypoint too"
            )
        if self.checkpoints == "sdk" and any(
            CHECKPOINT_DIR in arg for arg in (*self.argv, *self.resume_argv)
        ):
            raise ValueError(
                f"train.argv names {CHECKPOINT_DIR}, which only a script that keeps its own "
                'checkpoints has: set train.checkpoints = "folder" (or take the argument out)'
            )
        encoded = json.dumps(self.args, allow_nan=False)
        if len(encoded) > MAX_ARGS_BYTES:
            raise ValueError(
                f"train.args is {len(encoded)} bytes as JSON, over {MAX_ARGS_BYTES}: pass a "
                "file in train.code instead"
            )
        return self

    @property
    def user_code(self) -> bool:
        return self.entrypoint is not None

    @property
    def keeps_its_own_checkpoints(self) -> bool:
        """A script as it is (level 1): it saves into its folder, which Forgeline commits."""
        return self.checkpoints == "folder"

    def script_argv(self, checkpoint_folder: str, resumed: bool) -> list[str]:
        """The script's arguments on a node whose checkpoint folder is `checkpoint_folder`:
        argv, then resume_argv when the folder holds the run's last commit."""
        argv = [*self.argv, *(self.resume_argv if resumed else [])]
        return [arg.replace(CHECKPOINT_DIR, checkpoint_folder) for arg in argv]


class ResourcesSpec(_Strict):
    nodes: int = Field(1, ge=1, le=4096)
    gpus_per_node: int = Field(1, ge=1, le=64)
    team: Name = Field("default", description="the queue (team) whose quota the run uses")
    priority: int = Field(0, ge=-100, le=100)
    preemptible: bool = Field(True, description="may borrow idle capacity; may be preempted")
    max_runtime_h: float | None = Field(None, gt=0, le=24 * 365, description="default: cluster's")
    gpu_type: str | None = Field(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", description="e.g. h100; None: any"
    )
    allow_multi_pod: bool = True
    topology: str | None = Field(
        None,
        pattern=NAME_PATTERN,
        description='all of the gang inside one unit of this level: "pod", or a level the '
        'cluster file declares, such as "rack"; None: packed as tightly as the idle nodes allow',
    )
    topology_wait_min: float | None = Field(
        None,
        ge=0,
        le=7 * 24 * 60,
        description="with topology: wait at most this long for one unit, then take the fewest "
        "units (0: only prefer it); None: wait for one unit as long as it takes",
    )
    min_nodes: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="elastic: when a failed node cannot be replaced (no spare, no free node), "
        "train on as few as this many nodes and grow back at a checkpoint; None: always `nodes`",
    )

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @model_validator(mode="after")
    def _topology_is_a_level(self) -> ResourcesSpec:
        if self.topology == "node":
            raise ValueError(
                'resources.topology = "node" asks for one node: set resources.nodes = 1 '
                '(a gang\'s nodes are whole), or name a wider level such as "rack"'
            )
        if self.topology_wait_min is not None and self.topology is None:
            raise ValueError(
                "resources.topology_wait_min is set without resources.topology: name the level "
                'to wait for (such as "rack"), or leave topology_wait_min out'
            )
        if self.topology == "pod" and not self.allow_multi_pod and self.topology_wait_min:
            raise ValueError(
                "resources.allow_multi_pod = false already keeps the gang in one pod for ever: "
                "drop topology_wait_min, or allow_multi_pod"
            )
        return self

    @model_validator(mode="after")
    def _min_nodes_at_most_nodes(self) -> ResourcesSpec:
        if self.min_nodes is not None and self.min_nodes > self.nodes:
            raise ValueError(
                f"min_nodes ({self.min_nodes}) must be at most nodes ({self.nodes}): a run "
                "shrinks to min_nodes and grows back to nodes"
            )
        return self


PIPELINE_SCHEDULES = ("1F1B", "interleaved-1F1B", "zero-bubble")


class ParallelSpec(_Strict):
    """How the gang's ranks split the work; pipeline × replicate × shard × tensor = the world."""

    pipeline: int = Field(
        1,
        ge=1,
        le=1024,
        description="pipeline stages: the model's layers split in order, each stage's ranks "
        "passing activations forward and gradients back every micro-batch",
    )
    replicate: int | None = Field(
        None, ge=1, le=1 << 20, description="data-parallel replicas (DDP); None: what is left"
    )
    shard: int = Field(1, ge=1, le=1 << 20, description="fully sharded ranks (FSDP2, ZeRO-3)")
    tensor: int = Field(1, ge=1, le=1024, description="tensor-parallel ranks inside a block")
    schedule: Literal["1F1B", "interleaved-1F1B", "zero-bubble"] = Field(
        "1F1B",
        description="how a pipeline orders its micro-batches: 1F1B (one stage a rank); "
        "interleaved-1F1B (stages_per_rank stages a rank, a smaller bubble for more "
        "point-to-point traffic); zero-bubble (interleaved, each backward split into its "
        "input and weight halves to fill the bubble)",
    )
    stages_per_rank: int | None = Field(
        None,
        ge=1,
        le=64,
        description="stages each pipeline rank holds (virtual stages); None: 1 for 1F1B, 2 for "
        "the interleaved schedules",
    )
    microbatches: int | None = Field(
        None,
        ge=1,
        le=1 << 16,
        description="micro-batches a pipeline step splits each data-parallel rank's batch "
        "into; None: the fewest that keep the bubble at most max_bubble",
    )
    max_bubble: float = Field(
        0.25,
        gt=0,
        lt=1,
        description="microbatches = None: the largest share of a step the pipeline may idle",
    )
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none",
        description='recompute activations in backward to hold less of them: "full" keeps '
        "each block's input and runs its forward again (about a third more compute), "
        '"selective" keeps the products and attention and recomputes the cheap operations '
        "around them (norms, activations, dropout); the built-in GPT's blocks, or those a "
        "script names with run.recompute_activations()",
    )

    def degrees(self, world: int) -> tuple[int, int, int]:
        """(replicate, shard, tensor) for a gang of `world` ranks, `pipeline` stages of them;
        ValueError if they do not fit."""
        inner = self.pipeline * self.shard * self.tensor
        replicate = self.replicate if self.replicate is not None else max(1, world // inner)
        if replicate * inner != world:
            staged = f"parallel.pipeline ({self.pipeline}) × " if self.pipeline > 1 else ""
            raise ValueError(
                f"{staged}parallel.replicate ({replicate}) × parallel.shard ({self.shard}) × "
                f"parallel.tensor ({self.tensor}) = {replicate * inner}, but the gang has "
                f"resources.nodes × resources.gpus_per_node = {world} ranks: make the product "
                "equal the world size"
            )
        return replicate, self.shard, self.tensor

    @property
    def virtual_stages(self) -> int:
        """Stages a pipeline rank holds."""
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 1 if self.schedule == "1F1B" else 2

    @property
    def stages(self) -> int:
        """The pipeline's stages in all: its ranks × the stages each holds."""
        return self.pipeline * self.virtual_stages if self.pipeline > 1 else 1

    def bubble(self, microbatches: int) -> float:
        """The share of a step a pipeline idles (Narayanan et al. 2021): (P − 1)/(v·M + P − 1)
        for P ranks of v stages each over M micro-batches; zero-bubble fills most of it with
        the weights' half of the backward, a third of the work, so a third of it is left."""
        p, v = self.pipeline, self.virtual_stages
        if p == 1:
            return 0.0
        idle = (p - 1) / (v * microbatches + p - 1)
        return idle / 3 if self.schedule == "zero-bubble" else idle

    def microbatches_for(self, local_batch: int) -> int:
        """The spec's microbatches, else the fewest that divide this rank's batch (at least the
        pipeline's ranks for 1F1B) and keep the bubble at most max_bubble (else the most there
        can be: one sequence each)."""
        if self.microbatches is not None or self.pipeline == 1:
            return self.microbatches or 1
        least = self.pipeline if self.schedule == "1F1B" else 1  # 1F1B: one in flight a stage
        fitting = [m for m in range(least, local_batch + 1) if local_batch % m == 0]
        for m in fitting:
            if self.bubble(m) <= self.max_bubble:
                return m
        return fitting[-1] if fitting else local_batch


class RecoverySpec(_Strict):
    max_restarts: int = Field(3, ge=0, le=100)
    heartbeat_timeout_s: int = Field(15, ge=2, le=3600)
    node_mtbf_hours: float = Field(
        4380.0, gt=0, description="a node's mean time between failures (checkpoint_every = auto)"
    )
    hang_factor: float = Field(
        20.0, gt=1, le=10_000, description="no progress for this × the median report gap: hung"
    )
    hang_min_s: float = Field(60.0, ge=1, description="never call a hang sooner than this")
    exit_grace_s: float = Field(
        120.0,
        ge=1,
        le=3600,
        description="once one node's ranks have ended at the run's end, how long the other "
        "nodes' may take to exit before they are stopped (a rank stuck in its teardown)",
    )
    start_limit_s: float = Field(
        1800.0,
        ge=1,
        description="how long a rank script's own set-up may run (before forgeline.init(), "
        "run.restore() and run.steps()) and its first step may take; past it, set-up is the "
        "script's error (the run fails at once), a first step a hang",
    )
    straggler_policy: Literal["off", "report", "swap"] = Field(
        "report",
        description="a rank persistently slower than the rest: report it (a health event), or "
        "swap its node (checkpoint, cordon the node, continue on a spare)",
    )
    straggler_factor: float = Field(
        1.5, gt=1, le=100, description="slower than the others' median by this: a slow window"
    )
    straggler_window_steps: int = Field(20, ge=2, le=100_000)
    straggler_window_s: float = Field(
        5.0,
        ge=0,
        le=86_400,
        description="a window also spans at least this many seconds of steps: where steps are "
        "short, a second of a starved but healthy rank must not fill a window",
    )
    straggler_windows: int = Field(3, ge=1, le=1000, description="slow windows in a row to act")
    max_swaps: int = Field(
        10,
        ge=0,
        le=1000,
        description="straggler swaps a run may make (they cost no restart); past them a slow "
        "node is reported and kept, so a fleet of stragglers cannot re-queue the run for ever",
    )

    suspect_mads: float = Field(
        10.0,
        ge=0,
        le=1000,
        description="a rank whose own gradient norm moves this many median absolute deviations "
        "from its history and from the rest of the gang's is reported as a corruption suspect "
        "(a health event, not a verdict); 0 turns the watch off",
    )
    suspect_window_steps: int = Field(
        50, ge=5, le=100_000, description="the steps of history the suspect watch compares with"
    )

    shadow_every: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="every this many steps each data-parallel replica recomputes another "
        "node's micro-batch and the gang compares the gradients (a verdict names and "
        "quarantines a node that computes wrong); 0: off. The script calls "
        "run.recompute_with() (the built-in trainer does); two data-parallel groups or more",
    )
    shadow_rtol: float = Field(
        0.0,
        ge=0,
        le=0.1,
        description="how far a recompute may differ, relatively: 0 (bitwise) where kernels are "
        "deterministic, as on CPU; on GPUs it must be above 0 (refused at 0: their kernels are "
        "not bitwise reproducible)",
    )

    def shadow_settings(self) -> dict:
        """What the ranks' shadow checks need (trainer.shadow_check.ShadowSettings's fields)."""
        return {"every": self.shadow_every, "rtol": self.shadow_rtol} if self.shadow_every else {}

    def spike_settings(self) -> dict:
        """What the ranks' suspect watch needs (trainer.spike_watch.SpikeSettings's fields)."""
        return {"mads": self.suspect_mads, "window": self.suspect_window_steps}

    def straggler_settings(self) -> dict:
        """What the ranks need (trainer.stragglers.StragglerWatch, and the policy)."""
        return {
            "policy": self.straggler_policy,
            "watch": {
                "window": self.straggler_window_steps,
                "factor": self.straggler_factor,
                "windows": self.straggler_windows,
                "min_window_s": self.straggler_window_s,
            },
        }

    def gang_mtbf_s(self, nodes: int, node_seconds: float = 0.0, failures: int = 0) -> float:
        """Failures of independent nodes add up: a gang of N fails N times as often.

        A node's MTBF is the fleet's observed node time over its failures, with node_mtbf_hours
        as the prior worth one failure: a young fleet with two deaths in an hour is not taken
        to fail every half hour, and a long record outweighs the guess.
        """
        node_mtbf_s = (self.node_mtbf_hours * 3600 + node_seconds) / (1 + failures)
        return node_mtbf_s / nodes


class RegistrySpec(_Strict):
    model_name: Name | None = None
    sample_prompt: str = Field("\n", max_length=1000)
    sample_prompts: list[Annotated[str, Field(max_length=1000)]] = Field(
        [], max_length=16, description="more prompts to sample at evaluation (after sample_prompt)"
    )
    sample_tokens: int = Field(200, ge=1, le=4096)
    max_val_loss: float | None = Field(
        None, gt=0, description="eval gate: approval needs val loss at most this (or an override)"
    )
    approval_window_hours: float = Field(
        168.0, gt=0, le=24 * 365, description="nobody decides within this: the run ends EXPIRED"
    )
    # A script that keeps its own checkpoints (train.checkpoints = "folder") says which of its
    # final commit's files make the model: its weights, config, tokenizer.
    files: list[_FolderGlob] = Field(
        [],
        max_length=64,
        description='train.checkpoints = "folder": the files of the final commit the version '
        'holds, as globs in the checkpoint folder ("last.pt", "tokenizer/*"); empty: all of them',
    )

    @property
    def prompts(self) -> list[str]:
        return [self.sample_prompt, *self.sample_prompts]


class RunSpec(_Strict):
    name: Name
    owner: Name = "anonymous"
    data: DataSpec
    model: ModelSpec = ModelSpec()
    train: TrainSpec = TrainSpec()
    resources: ResourcesSpec = ResourcesSpec()
    parallel: ParallelSpec = ParallelSpec()
    recovery: RecoverySpec = RecoverySpec()
    registry: RegistrySpec = RegistrySpec()

    @field_validator("name")
    @classmethod
    def _not_another_workflow_s_id(cls, name: str) -> str:
        if why := reserved_id(name):
            raise ValueError(f"{name!r} is {why}: give the run another name")
        return name

    @property
    def model_name(self) -> str:
        return self.registry.model_name or self.name

    def after_swaps(self, swaps: int) -> RunSpec:
        """The spec the nodes train by once the run has swapped out `swaps` stragglers: past
        `recovery.max_swaps` a slow node is reported and kept, so a fleet of stragglers cannot
        keep the run re-queueing for ever."""
        recovery = self.recovery
        if recovery.straggler_policy != "swap" or swaps < recovery.max_swaps:
            return self
        kept = recovery.model_copy(update={"straggler_policy": "report"})
        return self.model_copy(update={"recovery": kept})

    def on_nodes(self, nodes: int) -> RunSpec:
        """The spec a gang of `nodes` trains by: this one on `resources.nodes`, or, on fewer
        nodes after an elastic shrink, the same global batch (`train.batch_size`, so the loss
        curve is the full gang's) with more gradient accumulation, so no rank's micro-batch is
        larger than on the full gang (the memory the run was sized for). ValueError if the
        layout cannot be laid out on that many nodes."""
        if nodes == self.resources.nodes:
            return self
        resources = self.resources.model_copy(update={"nodes": nodes})
        train = self.train.model_copy(update={"grad_accum_steps": self._accumulation_on(nodes)})
        return self.model_copy(update={"resources": resources, "train": train})

    def layout_summary(self) -> str:
        """The layout in a few words ("pipeline 2 (1F1B) × shard 2 × tensor 2")."""
        parallel = self.parallel
        replicate, shard, tensor = parallel.degrees(self.resources.world_size)
        parts = (
            [f"pipeline {parallel.pipeline} ({parallel.schedule})"] if parallel.pipeline > 1 else []
        )
        degrees = (("replicate", replicate), ("shard", shard), ("tensor", tensor))
        parts += [f"{name} {degree}" for name, degree in degrees if degree > 1]
        summary = " × ".join(parts) or "one rank"
        if parallel.activation_checkpointing != "none":
            summary += f", {parallel.activation_checkpointing} recompute"
        return summary

    def job_layout(self) -> dict[str, int | str]:
        """The layout the ranks build (`TrainJob.layout`): the degrees for this gang, the
        pipeline's schedule and micro-batches, activation recomputation."""
        parallel = self.parallel
        replicate, shard, tensor = parallel.degrees(self.resources.world_size)
        layout: dict[str, int | str] = {"replicate": replicate, "shard": shard, "tensor": tensor}
        if parallel.pipeline > 1:
            local = self.train.batch_size // (replicate * shard)
            layout |= {
                "pipeline": parallel.pipeline,
                "schedule": parallel.schedule,
                "stages_per_rank": parallel.virtual_stages,
                "microbatches": parallel.microbatches_for(local),
            }
        return layout | {"activation_checkpointing": parallel.activation_checkpointing}

    def _accumulation_on(self, nodes: int) -> int:
        batch = self.train.batch_size
        full_replicate, full_shard, _ = self.parallel.degrees(self.resources.world_size)
        replicate, shard, _ = self.parallel.degrees(nodes * self.resources.gpus_per_node)
        full_split = full_replicate * full_shard * self.train.grad_accum_steps
        ranks = replicate * shard
        # The smallest accumulation that splits the batch evenly (a divisor of each rank's
        # share) with micro-batches no larger than on the full gang.
        if batch % ranks == 0:
            share = batch // ranks
            least = -(-full_split // ranks)
            divisors = (d for i in range(1, math.isqrt(share) + 1) if share % i == 0
                        for d in (i, share // i))  # fmt: skip
            fitting = [d for d in divisors if d >= least]
            if fitting:
                return min(fitting)
        raise ValueError(
            f"train.batch_size ({batch}) cannot be split evenly over {ranks} data-parallel "
            f"ranks in micro-batches no larger than on the full gang ({batch // full_split})"
        )

    @model_validator(mode="after")
    def _files_of_a_folder(self) -> RunSpec:
        if self.registry.files and self.train.checkpoints != "folder":
            raise ValueError(
                "registry.files names files of a script's own checkpoint folder: it needs "
                'train.checkpoints = "folder" (the SDK\'s checkpoints register their weights)'
            )
        return self

    @model_validator(mode="after")
    def _recompute_through_the_sdk(self) -> RunSpec:
        if self.parallel.activation_checkpointing != "none" and self.train.checkpoints == "folder":
            raise ValueError(
                f'parallel.activation_checkpointing = "{self.parallel.activation_checkpointing}" '
                "is applied by the SDK (run.recompute_activations()), which a script that keeps "
                'its own checkpoints (train.checkpoints = "folder") does not call: use its '
                "library's own switch (gradient_checkpointing=True in Hugging Face's "
                "TrainingArguments, torch.utils.checkpoint in your model) and leave this none"
            )
        return self

    @model_validator(mode="after")
    def _pipeline_can_run(self) -> RunSpec:
        parallel = self.parallel
        if parallel.pipeline == 1:
            if parallel.stages_per_rank not in (None, 1) or parallel.microbatches is not None:
                raise ValueError(
                    "parallel.stages_per_rank and parallel.microbatches split a pipeline, and "
                    "parallel.pipeline is 1: set pipeline = 2 or more, or leave them out"
                )
            return self
        for why in self._pipeline_refusals():
            raise ValueError(why)
        return self

    def _pipeline_refusals(self) -> Iterator[str]:
        """Each reason a pipelined spec cannot run, with its fix."""
        parallel, train = self.parallel, self.train
        p, v, stages = parallel.pipeline, parallel.virtual_stages, parallel.stages
        if parallel.schedule == "1F1B" and v != 1:
            yield (
                f"parallel.stages_per_rank ({v}) needs an interleaved schedule: 1F1B holds one "
                'stage a rank; set schedule = "interleaved-1F1B" or "zero-bubble"'
            )
        if parallel.schedule != "1F1B" and v < 2:
            yield (
                f'parallel.schedule = "{parallel.schedule}" interleaves stages_per_rank ≥ 2 '
                'stages a rank: raise stages_per_rank, or use schedule = "1F1B"'
            )
        if not train.user_code and self.model.n_layer % stages:
            yield (
                f"model.n_layer ({self.model.n_layer}) must be a multiple of the pipeline's "
                f"stages, parallel.pipeline ({p}) × stages_per_rank ({v}) = {stages}: every "
                "stage holds as many blocks"
            )
        if train.grad_accum_steps != 1:
            yield (
                f"train.grad_accum_steps ({train.grad_accum_steps}) under a pipeline: its "
                "micro-batches are the accumulation; set grad_accum_steps = 1 and "
                "parallel.microbatches instead"
            )
        if train.checkpoints == "folder":
            yield (
                "parallel.pipeline splits the model through the SDK (run.pipeline()), which a "
                'script that keeps its own checkpoints (train.checkpoints = "folder") does not '
                "call: set pipeline = 1, or train through the SDK"
            )
        if self.recovery.shadow_every:
            yield (
                f"recovery.shadow_every ({self.recovery.shadow_every}) recomputes a whole "
                "micro-batch on one rank, and a pipeline stage holds only its own layers: set "
                "shadow_every = 0 under a pipeline (the non-finite and spike checks still "
                "watch every stage)"
            )
        if self.resources.min_nodes is not None and self.resources.min_nodes < self.resources.nodes:
            yield (
                "resources.min_nodes: an elastic gang shrinks its data-parallel ranks, and a "
                "pipeline's stages cannot shrink: leave min_nodes out under a pipeline"
            )
        try:
            replicate, shard, _ = parallel.degrees(self.resources.world_size)
        except ValueError:
            return  # _layout_fits_the_gang names it
        local = train.batch_size // (replicate * shard)
        microbatches = parallel.microbatches_for(local)
        if local % microbatches:
            yield (
                f"parallel.microbatches ({microbatches}) must divide each data-parallel rank's "
                f"batch, train.batch_size ({train.batch_size}) / data-parallel ranks "
                f"({replicate * shard}) = {local}: every micro-batch the same size"
            )
        if parallel.schedule == "1F1B" and microbatches < p:
            yield (
                f"parallel.microbatches ({microbatches}) is fewer than the pipeline's stages "
                f"({p}): 1F1B needs one micro-batch in flight a stage; give each data-parallel "
                f"rank a batch of {p} sequences or more, or use an interleaved schedule"
            )

    @model_validator(mode="after")
    def _layout_fits_the_gang(self) -> RunSpec:
        world = self.resources.world_size
        replicate, shard, tensor = self.parallel.degrees(world)
        for field, size in (("n_head", self.model.n_head), ("n_embd", self.model.n_embd)):
            if size % tensor:
                raise ValueError(
                    f"model.{field} ({size}) must be a multiple of parallel.tensor ({tensor}): "
                    "each tensor-parallel rank holds a whole number of heads and columns"
                )
        split = replicate * shard * self.train.grad_accum_steps
        if self.train.batch_size % split:
            # Name every knob behind the divisor: a change of resources.nodes alone can cause it.
            raise ValueError(
                f"train.batch_size ({self.train.batch_size}) must be a multiple of the "
                f"data-parallel ranks ({replicate * shard}) × train.grad_accum_steps "
                f"({self.train.grad_accum_steps}) = {split}; the data-parallel ranks are "
                f"resources.nodes × resources.gpus_per_node ({world}) / parallel.tensor ({tensor})"
                + (
                    f" / parallel.pipeline ({self.parallel.pipeline})"
                    if self.parallel.pipeline > 1
                    else ""
                )
            )
        return self

    @model_validator(mode="after")
    def _shadow_checks_data_parallel_ranks(self) -> RunSpec:
        # A rank is checked by the same position in another data-parallel group: with tensor
        # parallelism alone there is none.
        world = self.resources.world_size
        replicate, shard, tensor = self.parallel.degrees(world)
        if self.recovery.shadow_every and replicate * shard < 2:
            # Name every knob behind the count: one node of one GPU leaves one group too.
            raise ValueError(
                f"recovery.shadow_every ({self.recovery.shadow_every}) compares data-parallel "
                "ranks' own gradients, but there is one data-parallel group: resources.nodes × "
                f"resources.gpus_per_node ({world}) / parallel.tensor ({tensor}) = 1: use two "
                "data-parallel groups or more, or set shadow_every = 0"
            )
        return self

    @model_validator(mode="after")
    def _shrinks_to_min_nodes(self) -> RunSpec:
        """Every gang size an elastic run may be granted must lay out: refused at submission,
        not discovered after a failure."""
        resources = self.resources
        for nodes in range(resources.min_nodes or resources.nodes, resources.nodes):
            try:
                self.on_nodes(nodes)
            except ValueError as err:
                raise ValueError(
                    f"resources.min_nodes ({resources.min_nodes}): on {nodes} node(s) {err}; "
                    "raise min_nodes, or choose a batch size and layout that every size from "
                    "min_nodes to nodes divides"
                ) from None
        return self
