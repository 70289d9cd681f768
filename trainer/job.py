"""The job file a node hands to its torchrun ranks: everything a rank needs, as plain JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from infra.store.protocol import ObjectStore
from trainer.checkpoint_manifest import CheckpointManifest, PeerManifest

# In a job's folder: `forgeline chaos corrupt-grad` writes it, the ranks poison gradients once.
CHAOS_FILE = "CORRUPT_GRAD"


@dataclass
class ResumePoint:
    folder: str  # node-local copy of the checkpoint, already verified
    step: int
    tokens_seen: int
    manifest_key: str
    loss_history: list[list[float]] = field(default_factory=list)  # [step, loss] so far
    samples_seen: int | None = None  # the data cursor; None: step × batch_size (older manifests)
    # "peer": a peer-tier checkpoint (trainer.peer_tier), whose files the ranks gather from
    # the gang's nodes into `folder`; "store": fetched into `folder` before the ranks start.
    tier: str = "store"
    # For a peer-tier resume: the store checkpoint to fall back to when the gang does not hold
    # the peer tier whole; its `folder` is fetched by the ranks only then.
    fallback: ResumePoint | None = None
    # The manifest as the node agent read it from the store, kept beside the job: the ranks
    # read this copy (every rank of thousands reading the store at once is a burst of GETs).
    manifest_file: str | None = None

    def manifest(self, store: ObjectStore) -> CheckpointManifest:
        """The checkpoint's manifest: the agent's copy when there is one, else the store's."""
        # A peer manifest lists holders, not store keys.
        format = PeerManifest if self.tier == "peer" else CheckpointManifest
        if self.manifest_file is not None:
            return format.parse(Path(self.manifest_file).read_bytes(), self.manifest_key)
        return format.parse(store.get_bytes(self.manifest_key), self.manifest_key)


@dataclass
class TrainJob:
    run_id: str
    node_id: str
    generation: int
    model: dict  # GPTConfig fields
    train: dict  # TrainSpec fields
    train_shards: list[str]
    dtype: str
    store_url: str
    staging_dir: str
    progress_file: str
    lineage: dict = field(default_factory=dict)  # dataset snapshot, spec hash: into every manifest
    stop_file: str = ""  # when it appears, the ranks checkpoint and exit (preemption, drain)
    chaos_file: str = ""  # `forgeline chaos corrupt-grad` writes it: poison gradients once
    resume: ResumePoint | None = None
    node_index: int = 0  # this node's place in the allocation: fixes the ranks' order
    layout: dict = field(default_factory=dict)  # replicate, shard, tensor; empty: DDP over all
    twin_store_url: str = ""  # the twin site that serves while the store is down (none: "")
    val_shards: list[str] = field(default_factory=list)  # for eval_every
    init_weights: str = ""  # fine-tuning: a verified checkpoint folder or a safetensors file
    sample_log: str = ""  # audit: each rank appends the sample indices it trained on
    mtbf_s: float = 0.0  # the gang's mean time between failures, for checkpoint_every = "auto"
    nodes: int = 1  # nodes in the gang: a rank's node index is rank // (world // nodes)
    # Straggler detection: {"policy": off | report | swap, "watch": StragglerWatch's settings}
    stragglers: dict = field(default_factory=dict)
    # Finite outliers in the ranks' gradient norms: trainer.spike_watch.SpikeSettings as a dict
    # ({} in job files from before it: off)
    spikes: dict = field(default_factory=dict)
    # Shadow recompute: trainer.shadow_check.ShadowSettings as a dict ({}: off)
    shadow: dict = field(default_factory=dict)
    code_dir: str = ""  # the user's code snapshot on this node, verified; "": built-in trainer
    run_uid: str = ""  # the run's identity (trainer.run_identity); "": a run from before them
    # The node's folder of checkpoint copies (trainer.local_copies): "" keeps none
    local_copies: str = ""
    # The node's folder of peer-tier copies and its failure domain (pod): "" takes none
    peer_copies: str = ""
    node_domain: str = ""
    # A script that keeps its own checkpoints (train.checkpoints = "folder"): its folder on this
    # node (trainer.script_folder), and whether it holds the run's last commit ("": the SDK's)
    checkpoint_folder: str = ""
    checkpoint_resumed: bool = False
    script_argv: list[str] = field(default_factory=list)  # the script's sys.argv[1:]

    def stacks_file(self, local_rank: int) -> Path | None:
        """Where a rank of this node prints its threads' stacks when asked (SIGUSR1): one file
        a rank, beside the progress file, so stacks printed at once do not interleave."""
        if not self.progress_file:
            return None
        return Path(self.progress_file).parent / f"stacks-local-rank-{local_rank}.txt"

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps(asdict(self), indent=2))
        return path

    @classmethod
    def read(cls, path: Path) -> TrainJob:
        data = json.loads(path.read_text())
        resume = _resume_point(data.pop("resume"))
        return cls(**data, resume=resume)


def _resume_point(data: dict | None) -> ResumePoint | None:
    if not data:
        return None
    return ResumePoint(**{**data, "fallback": _resume_point(data.get("fallback"))})
