"""A model version's lineage, typed: what registration writes as MLflow tags and `forgeline
lineage` reads back.

MLflow keeps tags as strings under flat keys, so the stored form is `forgeline.<field>`:
"true"/"false" for flags, four decimals for losses, and the fields of a user's code only on a
version trained by one. `forgeline.lineage_format` names the version; versions registered
before it was written are version 1, the same fields. A version whose tags this build cannot
read (a field missing or malformed) is refused naming the tag.

Its own module, light on purpose: it imports no MLflow (the CLI reads lineage at start-up
speed).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict

from infra.stored_format import StoredRecord

PREFIX = "forgeline."
LINEAGE_FORMAT = "1"


class LineageTags(StoredRecord):
    """Where a registered version came from: code, data, checkpoint, evaluation, workflow."""

    model_config = ConfigDict(
        alias_generator=lambda name: PREFIX + name, populate_by_name=True, extra="ignore"
    )

    VERSION_FIELD: ClassVar[str] = PREFIX + "lineage_format"
    VERSIONS: ClassVar[tuple[Any, ...]] = (LINEAGE_FORMAT,)
    WHAT: ClassVar[str] = "model version's lineage"

    lineage_format: str = LINEAGE_FORMAT
    run: str
    owner: str
    temporal_workflow_id: str
    spec_sha256: str
    git_commit: str
    git_dirty: bool
    dataset_snapshot: str
    dataset_manifest_key: str
    dataset_manifest_sha256: str
    checkpoint_manifest_key: str
    checkpoint_step: int
    # None (no tag): a script as it is that reported no loss; eval_measured_on says "nothing".
    val_loss: float | None = None
    val_perplexity: float | None = None
    # Added since the first versions were registered (theirs lack them).
    packages_sha256: str | None = None  # of packages.txt, the installed packages
    eval_step: int | None = None
    # "held-out"; "train": the script reported no eval; "nothing": it reported no loss at all.
    eval_measured_on: str | None = None
    # Who measured val_loss: "platform" (Forgeline, from the final checkpoint) or "script" (the
    # run's own script reported it: self-reported, and the gate judged it as given).
    eval_source: Literal["platform", "script"] | None = None
    servable: bool = True  # False: weights and lineage only (the script gave no way to serve)
    # A user's training code (absent on a version of the built-in trainer).
    code_snapshot: str | None = None
    code_manifest_sha256: str | None = None
    entrypoint: str | None = None

    @classmethod
    def _unversioned(cls) -> Any:
        return LINEAGE_FORMAT  # the tags before the format was named are these

    def dump(self) -> dict[str, str]:
        """As MLflow tags: strings under `forgeline.<field>`; unset optional fields left out."""
        return {
            PREFIX + name: _as_tag(value)
            for name, value in self.model_dump(exclude_none=True).items()
        }

    @classmethod
    def read(cls, tags: Mapping[str, str], where: str) -> LineageTags:
        """The lineage among a version's tags (other tags are not its business)."""
        return cls.parse({k: v for k, v in tags.items() if k.startswith(PREFIX)}, where)


def _as_tag(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)
