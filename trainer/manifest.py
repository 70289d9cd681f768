"""Checkpoint manifests: the record that makes a set of checkpoint files a checkpoint.

A checkpoint lives under `runs/<run>/checkpoints/step-<n>/gen-<g>/`: each generation writes its
files and its manifest under keys of its own, so a paused older generation that comes back can
neither overwrite a newer one's committed files nor take the key of its manifest at the same
step. (Checkpoints written before this layout have their files and manifest directly under
`step-<n>/`; they are still read, resumed from and pruned.) `MANIFEST.json` is written last
with create-if-absent and lists every file with its key, size and sha256. Finding the latest
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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum

from infra.errors import IntegrityError, NotOnTwin, ObjectNotFound
from infra.store.door import DoorFenced
from infra.store.protocol import ObjectStore, check_claimed_files
from trainer.checkpoint_manifest import CheckpointManifest
from trainer.errors import CheckpointError
from trainer.run_identity import belongs, pinned

MANIFEST_NAME = "MANIFEST.json"
_MANIFEST_KEY = re.compile(r"/checkpoints/step-(\d+)/(?:gen-(\d+)/)?MANIFEST\.json$")
_GENERATION_FOLDER = re.compile(r"/checkpoints/step-\d+/gen-(\d+)/")


def checkpoint_prefix(run_id: str, step: int, generation: int) -> str:
    """The folder of one generation's checkpoint at `step`: its files and its manifest."""
    return f"runs/{run_id}/checkpoints/step-{step}/gen-{generation}"


def manifest_key(run_id: str, step: int, generation: int) -> str:
    return f"{checkpoint_prefix(run_id, step, generation)}/{MANIFEST_NAME}"


@dataclass(frozen=True)
class Commit:
    """Where one manifest lies in the store (its content unread)."""

    step: int
    generation: int | None  # None: the layout before per-generation folders
    key: str

    def file_keys(self, keys: list[str]) -> list[str]:
        """Of `keys`, the files of this checkpoint's folder (the manifest left out). A folder of
        the former layout is `step-<n>/` itself, and the generation folders in it are not its."""
        folder = self.key.removesuffix(MANIFEST_NAME)
        return [
            k
            for k in keys
            if k.startswith(folder)
            and k != self.key
            and (self.generation is not None or not k[len(folder) :].startswith("gen-"))
        ]


def commits(store: ObjectStore, run_id: str) -> list[Commit]:
    """Every manifest of the run, the newest step first; at one step the newest generation first
    (a manifest of the former layout last)."""
    return _commits_among(store.list(f"runs/{run_id}/checkpoints/"))


def _commits_among(keys: list[str]) -> list[Commit]:
    found = []
    for key in keys:
        if match := _MANIFEST_KEY.search(key):
            generation = None if match.group(2) is None else int(match.group(2))
            found.append(Commit(int(match.group(1)), generation, key))
    return sorted(found, key=_newest_first, reverse=True)


def _newest_first(commit: Commit) -> tuple[int, int]:
    return commit.step, -1 if commit.generation is None else commit.generation


@dataclass(frozen=True)
class CommittedCheckpoint:
    key: str
    manifest: CheckpointManifest

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def generation(self) -> int:
        return self.manifest.generation

    @property
    def tokens_seen(self) -> int:
        return self.manifest.tokens_seen


def generation_key(run_id: str, generation: int) -> str:
    return f"runs/{run_id}/generations/gen-{generation}.json"


def record_generation(
    store: ObjectStore, run_id: str, generation: int, resume_step: int, run_uid: str = ""
) -> None:
    """Fence out older generations: from now on they may only have committed up to
    `resume_step`. Written once per generation (a retried activity finds it there)."""
    record = {"generation": generation, "resume_step": resume_step}
    if run_uid:
        record["run_uid"] = run_uid
    store.put_if_absent(generation_key(run_id, generation), json.dumps(record).encode())


@dataclass(frozen=True)
class Fences:
    """The generations a run has started, each with the step it resumed from."""

    resume_steps: dict[int, int]

    @classmethod
    def read(cls, store: ObjectStore, run_id: str, run_uid: str = "") -> Fences:
        """The run's generation records (with `run_uid`, only those of that run)."""
        steps = {}
        for key in store.list(f"runs/{run_id}/generations/"):
            record = json.loads(store.get_bytes(key))
            if belongs(record, run_uid):
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


class CommitOutcome(Enum):
    """What a fenced manifest put came to."""

    COMMITTED = "committed"
    ALREADY_THERE = "already there"  # another writer of the same generation put it first
    TAKEN_BACK = "taken back"  # a later generation resumed from an earlier step meanwhile


def commit_fenced(
    store: ObjectStore,
    key: str,
    manifest: CheckpointManifest,
    run_id: str,
    run_uid: str,
    generation: int,
    step: int,
) -> CommitOutcome:
    """Put a manifest create-if-absent at `key`, then read the fences and delete it again if a
    later generation resumed from an earlier step. The fence is read after the put, not before:
    a generation paused between the two (SIGSTOP, a frozen host) would otherwise commit after
    a newer one resumed; readers pass over such a manifest anyway, and taking it back leaves
    nothing stale for anyone to read. Both tiers commit this way."""
    try:
        if not store.put_if_absent(key, manifest.dump_bytes()):
            return CommitOutcome.ALREADY_THERE
    except DoorFenced:  # a boxed rank's agent read the fences and refused or took it back
        return CommitOutcome.TAKEN_BACK
    if Fences.read(store, run_id, run_uid).why_stale(generation, step):
        store.delete(key)
        return CommitOutcome.TAKEN_BACK
    return CommitOutcome.COMMITTED


def delete_unless_fenced(store: ObjectStore, keys: Iterable[str]) -> None:
    """Delete what a fenced or taken-back save uploaded. A boxed rank's door refuses a fenced
    generation every delete as well as every write (DoorFenced): then the keys stay for the
    newer generation's prune, which removes files of fenced generations no manifest names."""
    for key in keys:
        try:
            store.delete(key)
        except DoorFenced:
            return


def committed_steps(store: ObjectStore, run_id: str) -> list[int]:
    """Steps that have a manifest, newest first."""
    return sorted({c.step for c in commits(store, run_id)}, reverse=True)


def counted(store: ObjectStore, run_id: str) -> list[CommittedCheckpoint]:
    """One readable manifest per step that the fences let count, newest first (files unverified:
    for a curve or a report, not for resuming). At a step with two, the newest generation's."""
    fences = Fences.read(store, run_id)
    found: dict[int, CommittedCheckpoint] = {}
    for commit in commits(store, run_id):
        if commit.step in found:
            continue
        try:
            manifest = read_manifest(store, commit.key)
            if fences.why_stale(manifest.generation, commit.step):
                continue
        except (IntegrityError, ObjectNotFound, ValueError, KeyError):
            continue
        found[commit.step] = CommittedCheckpoint(commit.key, manifest)
    return list(found.values())


def read_manifest(store: ObjectStore, key: str) -> CheckpointManifest:
    """The store-tier manifest at `key` (StoredFormatError, an IntegrityError, if it is not one
    this build reads)."""
    return CheckpointManifest.parse(store.get_bytes(key), key)


def check_checkpoint_claims(store: ObjectStore, manifest: CheckpointManifest) -> None:
    """Check every file the manifest lists is in the store with the size and sha256 the store
    claims for it (one HEAD each on S3): whole, not proven. Cheap enough for every resume and
    prune; the bytes themselves are hashed when a gang fetches them (fetch_checkpoint), and
    `forgeline lineage` hashes them (verify_stored_files)."""
    check_claimed_files(store, manifest.files, "checkpoint file")


# Why resume passes a checkpoint over for an older one. NotOnTwin: the primary is down and one of
# its files is there alone (the outage cut a checkpoint being written); an older checkpoint the
# twin holds whole beats waiting out the outage.
PASSED_OVER = (IntegrityError, ObjectNotFound, NotOnTwin, CheckpointError, ValueError, KeyError)


def find_latest(
    store: ObjectStore,
    run_id: str,
    max_generation: int,
    on_skip: Callable[[str], None] = lambda _: None,
    vet: Callable[[CheckpointManifest], None] = lambda _: None,
    run_uid: str = "",
    at_most_step: int | None = None,
) -> CommittedCheckpoint | None:
    """The newest checkpoint of the run (with `run_uid`: of that run alone) that verifies and
    was committed by generation ≤ max_generation (with `at_most_step`: at that step or
    before, as `forgeline resume --from` asks); `vet` may refuse one more (raising
    CheckpointError), and the search goes on past it."""
    fences = Fences.read(store, run_id, run_uid)
    for commit in commits(store, run_id):
        key, step = commit.key, commit.step
        if at_most_step is not None and step > at_most_step:
            continue  # not faulty, only later than asked: nothing to report
        try:
            manifest = read_manifest(store, key)
            if not manifest.belongs_to(run_uid):
                on_skip(f"{key}: another run's (run_uid {manifest.run_uid or 'none'})")
                continue
            if manifest.generation > max_generation:
                on_skip(f"{key}: generation {manifest.generation} > {max_generation}")
                continue
            if stale := fences.why_stale(manifest.generation, step):
                on_skip(f"{key}: {stale}")
                continue
            check_checkpoint_claims(store, manifest)
            vet(manifest)
        except PASSED_OVER as err:
            on_skip(f"{key}: {err}")
            continue
        return CommittedCheckpoint(key, manifest)
    return None


def newest_commit_of(store: ObjectStore, run_id: str, generation: int) -> int | None:
    """The newest step that `generation` committed and the fences let count (files unverified:
    this is for accounting, not for resuming)."""
    for checkpoint in counted(store, run_id):
        if checkpoint.generation == generation:
            return checkpoint.step
    return None


def prune(
    store: ObjectStore,
    run_id: str,
    keep: int,
    verified: set[str] | None = None,
    run_uid: str = "",
) -> list[int]:
    """Keep the newest `keep` checkpoints that resume could use; delete the others, any
    manifest a fenced-out generation committed, and the files a fenced-out generation uploaded
    but never committed. Manifest first, then files.

    Only a checkpoint whose files verify counts toward `keep`: a corrupt or unreadable one newer
    than those is left alone (resume passes over it; it is evidence) and never pushes a good
    one out, and the newest verified checkpoint is never deleted. Deleting the manifest first
    means a crash halfway leaves orphan files, never a manifest that points at files which are
    gone. `verified` caches manifests already checked (a writer prunes after every commit).
    A pinned checkpoint (registered: trainer.run_identity) is never deleted, nor, with
    `run_uid`, another run's.
    """
    fences = Fences.read(store, run_id, run_uid)
    keys = store.list(f"runs/{run_id}/checkpoints/")  # listed once: manifests and files
    keep_always = pinned(store, run_id)
    removed, kept = [], 0
    for commit in _commits_among(keys):
        state = _usability(store, fences, commit.key, commit.step, verified, run_uid)
        if state is Usability.FOREIGN or commit.key in keep_always:
            continue
        if kept < keep and state is not Usability.STALE:
            kept += state is Usability.USABLE
            continue  # a usable one is kept; a broken one newer than them is left as it is
        store.delete(commit.key)
        for leftover in commit.file_keys(keys):
            store.delete(leftover)
        if commit.step not in removed:
            removed.append(commit.step)
    for orphan in _uncommitted_files_of_fenced_generations(keys, fences):
        store.delete(orphan)
    return removed


def _uncommitted_files_of_fenced_generations(keys: list[str], fences: Fences) -> list[str]:
    """Files a superseded generation uploaded without a manifest next to them: it can commit
    nothing more (it checks the fences before it commits), so nothing will ever name them."""
    with_manifest = {k.removesuffix(MANIFEST_NAME) for k in keys if _MANIFEST_KEY.search(k)}
    orphans = []
    for key in keys:
        match = _GENERATION_FOLDER.search(key)
        if match is None or not fences.superseded(int(match.group(1))):
            continue
        if key[: match.end()] not in with_manifest:
            orphans.append(key)
    return orphans


class Usability(Enum):
    USABLE = "resume could load it"
    FOREIGN = "another run's"
    STALE = "committed by a fenced-out generation"
    BROKEN = "unreadable, or its files do not verify"


def _usability(
    store: ObjectStore,
    fences: Fences,
    key: str,
    step: int,
    verified: set[str] | None,
    run_uid: str = "",
) -> Usability:
    try:
        manifest = read_manifest(store, key)
        if not manifest.belongs_to(run_uid):
            return Usability.FOREIGN
        if fences.why_stale(manifest.generation, step):
            return Usability.STALE
        fingerprint = f"{key}@{manifest.committed_at}"
        if verified is None or fingerprint not in verified:
            check_checkpoint_claims(store, manifest)
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
    check_checkpoint_claims(store, manifest)
    saved = manifest.network
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
