"""The checkpoint manifest, typed: what `MANIFEST.json` of a checkpoint holds.

Written by rank 0 of a gang when a checkpoint commits (`trainer.checkpoint`, through
`trainer.manifest.commit_fenced`), last and create-if-absent; read by resume, pruning,
evaluation, registration, lineage and reports. A store-tier manifest lists every file with its
key; a peer-tier one (`trainer.peer_tier`) lists the two nodes that hold each file instead.

The format string is the version: `forgeline.checkpoint/1` and `forgeline.peer-checkpoint/1`.
Everything the training loop saves beside the weights (tokens and samples seen, the data
cursor, the loss history, the network, the last evaluation, lineage) is a field here; fields a
later build adds get defaults, so today's manifests keep loading.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from infra.stored_format import StoredRecord

MANIFEST_FORMAT = "forgeline.checkpoint/1"
PEER_FORMAT = "forgeline.peer-checkpoint/1"
# What a checkpoint's files are (`CheckpointManifest.contents`).
DCP_CONTENTS: Final = "dcp"
FOLDER_CONTENTS: Final = "folder"


class CheckpointFile(BaseModel):
    """One file of a checkpoint: its name in the checkpoint folder, its size and sha256, and
    where it is: a store key (store tier) or the nodes that hold it (peer tier)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str
    bytes: int
    sha256: str
    key: str = ""
    holders: list[str] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _one_tier(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A file of one tier says where it is in that tier's terms only: a store file has no
        holders, a peer file no key (as manifests have always been written)."""
        stored = handler(self)
        return {k: v for k, v in stored.items() if k not in ("key", "holders") or v}


class CheckpointManifest(StoredRecord):
    """A committed store-tier checkpoint."""

    VERSIONS: ClassVar[tuple[Any, ...]] = (MANIFEST_FORMAT,)
    WHAT: ClassVar[str] = "checkpoint manifest"

    format: str = MANIFEST_FORMAT
    run_id: str = ""
    run_uid: str = ""  # the run's identity ("": written before runs had one)
    step: int
    generation: int
    world_size: int = 0
    layout: dict[str, Any] = Field(default_factory=dict)  # strategy and degrees (DDP, FSDP, TP)
    committed_at: str = ""  # ISO time
    tokens_seen: int = 0
    samples_seen: int | None = None
    epoch: int = 0
    data_cursor: dict[str, Any] | None = None  # where the data loader resumes
    rng: str | None = None
    # Stored as "model_config" (pydantic reserves the name): the network's shape, checked by
    # init_from and used to load the weights.
    network: dict[str, Any] = Field(default_factory=dict, alias="model_config")
    train_config: dict[str, Any] | None = None
    loss_history: list[tuple[int, float]] = Field(default_factory=list)  # (step, loss)
    evaluation: dict[str, Any] | None = None  # the script's own held-out loss, if it measured
    serving: dict[str, Any] | None = None  # how the user's model is served, if it says
    # Lineage: the dataset the weights were trained on and the checkpoint they started from.
    dataset_snapshot: str | None = None
    dataset_manifest_sha256: str | None = None
    init_from: str | None = None
    # What the files are: the SDK's training state (torch.distributed.checkpoint files, read
    # through trainer.safe_load), or the files a script that never imports Forgeline wrote into
    # its checkpoint folder, each named by its '/'-separated path in it
    # (trainer.folder_checkpoint). Stored only for a folder: the SDK's manifests say what
    # they always said, and those written before the field are the SDK's.
    contents: Literal["dcp", "folder"] = DCP_CONTENTS
    files: list[CheckpointFile]

    @model_serializer(mode="wrap")
    def _contents_of_a_folder_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        stored = handler(self)
        if stored.get("contents") == DCP_CONTENTS:
            del stored["contents"]
        return stored

    def belongs_to(self, run_uid: str) -> bool:
        """Whether this is that run's checkpoint (a run without a uid takes any)."""
        return not run_uid or self.run_uid == run_uid

    def as_peer(self) -> PeerManifest:
        """The same checkpoint, committed to the peer tier."""
        return PeerManifest.model_validate({**self.dump(), "format": PEER_FORMAT, "tier": "peer"})


class PeerManifest(CheckpointManifest):
    """A committed peer-tier checkpoint: its files stay on the gang's nodes."""

    VERSIONS: ClassVar[tuple[Any, ...]] = (PEER_FORMAT,)
    WHAT: ClassVar[str] = "peer checkpoint manifest"

    format: str = PEER_FORMAT
    tier: str = "peer"
