"""Whose checkpoints these are: a run's claim on its name in the store, and the checkpoints
that must outlive pruning.

A run's name is its key prefix (`runs/<run>/`), but a name is not a run forever: Temporal
forgets a finished run after the namespace's retention and the name can be submitted again,
and two stacks can share one bucket. A run submitted since identities exist carries a
`run_uid` (made at submission, kept by `forgeline resume`), and before each gang it claims the
prefix: `runs/<run>/identity.json`, written create-if-absent. Another run of the same name
finds that claim, or checkpoints that nobody claimed (a run from before identities), and is
refused before it reads, resumes from or prunes anything of theirs. Manifests and generation
records carry the uid as well, and resume and pruning pass over what is not their run's.

A registered checkpoint is pinned (`runs/<run>/pins/step-<n>-gen-<g>.json` names its manifest)
before its model version exists, and pruning never deletes a pinned checkpoint: a model
version's weights and lineage point at it. A rank pins the checkpoints a rollback past a
suspect step may need (trainer.rollback_points) under its own generation's folder,
`runs/<run>/pins/by-gen-<g>/`.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

from infra.store.protocol import ObjectStore
from trainer.errors import CheckpointError


class RunNameTaken(CheckpointError):
    """The store's prefix for this run name belongs to another run."""


def identity_key(run_id: str) -> str:
    return f"runs/{run_id}/identity.json"


def claim(store: ObjectStore, run_id: str, run_uid: str) -> None:
    """Make `runs/<run_id>/` this run's, or raise RunNameTaken when it is another's. A run
    without a uid (submitted before identities) claims nothing and is let through as before."""
    if not run_uid:
        return
    key = identity_key(run_id)
    if not store.exists(key):
        unclaimed = store.list(f"runs/{run_id}/checkpoints/") or store.list(
            f"runs/{run_id}/generations/"
        )
        if unclaimed:
            raise RunNameTaken(
                f"run name {run_id!r}: {store.url}/runs/{run_id}/ already holds checkpoints of "
                "an earlier run of that name (from before run identities, e.g. "
                f"{unclaimed[0]}); this run would resume from its weights and prune them. "
                f"Submit under another name, or delete runs/{run_id}/ from the store if that "
                "run is gone for good"
            )
        record = {"run_uid": run_uid, "claimed_at": datetime.now(UTC).isoformat()}
        if store.put_if_absent(key, json.dumps(record).encode()):
            return
    held = json.loads(store.get_bytes(key))
    if held.get("run_uid") != run_uid:
        raise RunNameTaken(
            f"run name {run_id!r}: {store.url}/runs/{run_id}/ belongs to another run of that "
            f"name (run_uid {held.get('run_uid')}, claimed {held.get('claimed_at')}): the name "
            "was used before and its history has since expired, or another stack shares this "
            f"store. Submit under another name, or delete runs/{run_id}/ from the store if "
            "that run is gone for good"
        )


def belongs(record: dict, run_uid: str) -> bool:
    """Whether a manifest or generation record is this run's: any record for a run without a
    uid (as before identities), else only one that carries the same uid."""
    return not run_uid or record.get("run_uid") == run_uid


def pin_key(run_id: str, step: int, generation: int, pinned_by: int | None = None) -> str:
    """Where the pin of the checkpoint of `step` by `generation` is kept. A rank's pin is filed
    under the generation that pins (`pinned_by`): a boxed rank's store door lets a generation
    write only keys of its own, and a rank may pin a checkpoint an earlier one committed."""
    name = f"step-{step}-gen-{generation}.json"
    by = "" if pinned_by is None else f"by-gen-{pinned_by}/"
    return f"runs/{run_id}/pins/{by}{name}"


def pin(
    store: ObjectStore,
    run_id: str,
    manifest_key: str,
    step: int,
    generation: int,
    pinned_by: int | None = None,
) -> None:
    """Keep this checkpoint for good: a model version is being made from it, or a rollback
    past a suspect step may need it (`pinned_by`: the rank's own generation)."""
    record = {"manifest_key": manifest_key, "pinned_at": datetime.now(UTC).isoformat()}
    store.put_bytes(pin_key(run_id, step, generation, pinned_by), json.dumps(record).encode())


def pinned(store: ObjectStore, run_id: str) -> set[str]:
    """The manifest keys of the run's pinned checkpoints."""
    return {
        json.loads(store.get_bytes(key))["manifest_key"]
        for key in store.list(f"runs/{run_id}/pins/")
    }
