"""Checkpoint manifests: the record that makes a set of checkpoint files a checkpoint.

A checkpoint lives under `runs/<run>/checkpoints/step-<n>/`; its `MANIFEST.json` is written
last with create-if-absent and lists every file with its size and sha256. Finding the latest
checkpoint means walking manifests from the newest step down and taking the first whose files
all verify, so a torn upload (no manifest) or a flipped byte (hash mismatch) costs one
checkpoint interval, never the run.

Fencing: before a generation starts, the run records `runs/<run>/generations/gen-<g>.json` with
the step it resumes from. From then on a manifest of an older generation counts only if its step
is at most that resume step: a rank of an old generation that is still alive (a paused node that
came back) can commit nothing that resume or pruning would use, and it checks the records itself
before it uploads or commits, then stops.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from infra.errors import IntegrityError, ObjectNotFound
from infra.store import ObjectStore
from trainer.errors import CheckpointError

MANIFEST_NAME = "MANIFEST.json"
MANIFEST_FORMAT = "forgeline.checkpoint/1"
_STEP_DIR = re.compile(r"/step-(\d+)/")


def checkpoint_prefix(run_id: str, step: int) -> str:
    return f"runs/{run_id}/checkpoints/step-{step}"


def manifest_key(run_id: str, step: int) -> str:
    return f"{checkpoint_prefix(run_id, step)}/{MANIFEST_NAME}"


@dataclass(frozen=True)
class CommittedCheckpoint:
    key: str
    manifest: dict

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def generation(self) -> int:
        return int(self.manifest["generation"])

    @property
    def tokens_seen(self) -> int:
        return int(self.manifest["tokens_seen"])


def generation_key(run_id: str, generation: int) -> str:
    return f"runs/{run_id}/generations/gen-{generation}.json"


def record_generation(store: ObjectStore, run_id: str, generation: int, resume_step: int) -> None:
    """Fence out older generations: from now on they may only have committed up to
    `resume_step`. Written once per generation (a retried activity finds it there)."""
    record = {"generation": generation, "resume_step": resume_step}
    store.put_if_absent(generation_key(run_id, generation), json.dumps(record).encode())


@dataclass(frozen=True)
class Fences:
    """The generations a run has started, each with the step it resumed from."""

    resume_steps: dict[int, int]

    @classmethod
    def read(cls, store: ObjectStore, run_id: str) -> Fences:
        steps = {}
        for key in store.list(f"runs/{run_id}/generations/"):
            record = json.loads(store.get_bytes(key))
            steps[int(record["generation"])] = int(record["resume_step"])
        return cls(steps)

    def superseded(self, generation: int) -> bool:
        """A later generation has started: this one must commit nothing more."""
        return any(g > generation for g in self.resume_steps)

    def why_stale(self, generation: int, step: int) -> str | None:
        """Why a manifest of `generation` at `step` must not be used, or None if it may."""
        for later, resume_step in sorted(self.resume_steps.items()):
            if later > generation and step > resume_step:
                return (
                    f"committed by generation {generation} at step {step}, after generation "
                    f"{later} had resumed from step {resume_step}"
                )
        return None


def committed_steps(store: ObjectStore, run_id: str) -> list[int]:
    """Steps that have a manifest, newest first."""
    steps = []
    for key in store.list(f"runs/{run_id}/checkpoints/"):
        match = _STEP_DIR.search(key)
        if match and key.endswith(f"/{MANIFEST_NAME}"):
            steps.append(int(match.group(1)))
    return sorted(steps, reverse=True)


def read_manifest(store: ObjectStore, key: str) -> dict:
    manifest = json.loads(store.get_bytes(key))
    if manifest.get("format") != MANIFEST_FORMAT:
        raise IntegrityError(f"{key} is not a {MANIFEST_FORMAT} manifest")
    return manifest


def verify_files(store: ObjectStore, manifest: dict, what: str = "checkpoint file") -> None:
    """Check every file the manifest lists is in the store with its recorded size and sha256."""
    for entry in manifest["files"]:
        try:
            size, sha256 = store.digest(entry["key"])
        except ObjectNotFound:
            raise IntegrityError(f"{what} {entry['key']} is missing") from None
        if size != entry["bytes"] or sha256 != entry["sha256"]:
            raise IntegrityError(
                f"{what} {entry['key']} is corrupt: expected {entry['bytes']} bytes "
                f"with sha256 {entry['sha256'][:12]}…, found {size} bytes with {sha256[:12]}…"
            )


def find_latest(
    store: ObjectStore,
    run_id: str,
    max_generation: int,
    on_skip: Callable[[str], None] = lambda _: None,
    vet: Callable[[dict], None] = lambda _: None,
) -> CommittedCheckpoint | None:
    """The newest checkpoint that verifies and was committed by generation ≤ max_generation;
    `vet` may refuse one more (raising CheckpointError), and the search goes on past it."""
    fences = Fences.read(store, run_id)
    for step in committed_steps(store, run_id):
        key = manifest_key(run_id, step)
        try:
            manifest = read_manifest(store, key)
            if int(manifest["generation"]) > max_generation:
                on_skip(f"{key}: generation {manifest['generation']} > {max_generation}")
                continue
            if stale := fences.why_stale(int(manifest["generation"]), step):
                on_skip(f"{key}: {stale}")
                continue
            verify_files(store, manifest)
            vet(manifest)
        except (IntegrityError, ObjectNotFound, CheckpointError, ValueError, KeyError) as err:
            on_skip(f"{key}: {err}")
            continue
        return CommittedCheckpoint(key, manifest)
    return None


def newest_commit_of(store: ObjectStore, run_id: str, generation: int) -> int | None:
    """The newest step that `generation` committed and the fences let count (files unverified:
    this is for accounting, not for resuming)."""
    fences = Fences.read(store, run_id)
    for step in committed_steps(store, run_id):
        try:
            committed_by = int(read_manifest(store, manifest_key(run_id, step))["generation"])
        except (IntegrityError, ObjectNotFound, ValueError, KeyError):
            continue
        if committed_by == generation and fences.why_stale(generation, step) is None:
            return step
    return None


def prune(
    store: ObjectStore, run_id: str, keep: int, verified: set[str] | None = None
) -> list[int]:
    """Keep the newest `keep` checkpoints that resume could use; delete the others, and any
    manifest a fenced-out generation committed. Manifest first, then files.

    Only a checkpoint whose files verify counts toward `keep`: a corrupt or unreadable one newer
    than those is left alone (resume passes over it; it is evidence) and never pushes a good
    one out, and the newest verified checkpoint is never deleted. Deleting the manifest first
    means a crash halfway leaves orphan files, never a manifest that points at files which are
    gone. `verified` caches manifests already checked (a writer prunes after every commit).
    """
    fences = Fences.read(store, run_id)
    removed, kept = [], 0
    for step in committed_steps(store, run_id):
        key = manifest_key(run_id, step)
        state = _usability(store, fences, key, step, verified)
        if kept < keep and state is not Usability.STALE:
            kept += state is Usability.USABLE
            continue  # a usable one is kept; a broken one newer than them is left as it is
        store.delete(key)
        for leftover in store.list(checkpoint_prefix(run_id, step) + "/"):
            store.delete(leftover)
        removed.append(step)
    return removed


class Usability(Enum):
    USABLE = "resume could load it"
    STALE = "committed by a fenced-out generation"
    BROKEN = "unreadable, or its files do not verify"


def _usability(
    store: ObjectStore, fences: Fences, key: str, step: int, verified: set[str] | None
) -> Usability:
    try:
        manifest = read_manifest(store, key)
        if fences.why_stale(int(manifest["generation"]), step):
            return Usability.STALE
        fingerprint = f"{key}@{manifest.get('committed_at')}"
        if verified is None or fingerprint not in verified:
            verify_files(store, manifest)
            if verified is not None:
                verified.add(fingerprint)
    except (IntegrityError, ObjectNotFound, ValueError, KeyError):
        return Usability.BROKEN
    return Usability.USABLE


def load_for_init(store: ObjectStore, key: str, architecture: dict) -> CommittedCheckpoint:
    """A committed checkpoint to start a new run's weights from (fine-tuning): it must exist,
    verify, and have exactly the network the new run declares."""
    try:
        manifest = read_manifest(store, key)
    except ObjectNotFound:
        raise CheckpointError(
            f"init_from: no checkpoint manifest at {key} (pruned or never committed?)"
        ) from None
    verify_files(store, manifest)
    saved = manifest["model_config"]
    # Dropout is a training choice, not part of the network's shape.
    differ = sorted(
        name
        for name in {*saved, *architecture} - {"dropout"}
        if saved.get(name) != architecture.get(name)
    )
    if differ:
        detail = ", ".join(f"{n}: {saved.get(n)} there, {architecture.get(n)} here" for n in differ)
        raise CheckpointError(
            f"init_from {key} has a different network ({detail}): declare the same model "
            "(and a dataset with the same tokenizer) to fine-tune it"
        )
    return CommittedCheckpoint(key, manifest)
