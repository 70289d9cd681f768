"""Sharded, asynchronous checkpoints with torch.distributed.checkpoint, committed by manifest.

A save runs in four stages, and training is blocked by none of them:

1. stage: this rank's state (model and optimizer, DTensor shards as they are; under data
   parallelism alone, its share of the replicated state) is copied into fresh host tensors in
   the background, after the step that made it (trainer.checkpoint_staging). The loop overlaps
   it with the next forward and backward and waits for it only before the next
   `optimizer.step()`, the first moment the weights change.
2. write: `dcp.async_save` writes the staged copy to node-local disk, on a gloo group of its own
   (sharing the training group aborts with a collective mismatch or hangs).
3. upload: each rank puts the files it wrote into the object store, with size and sha256.
4. commit: the ranks gather their file lists to rank 0, which writes `MANIFEST.json` last with
   create-if-absent and prunes to `keep` checkpoints. No manifest, no checkpoint.

A generation that has been superseded (`trainer.manifest.Fences`) uploads and commits nothing:
each rank checks before it uploads, rank 0 again before it commits, and the save reports itself
fenced so the loop stops.

Beside the model and the optimizer, a save keeps what the script names in `extra`
(`forgeline.kept_state`: an LR scheduler, an EMA, a scaler, a loader's position) under the key
`state`, through the same stages: its tensors sharded and resharded as the model's, its other
values as DCP's plain items.

One save is in flight at a time: a new one first waits for the previous commit. Loading fetches
and verifies every file first (`fetch_checkpoint`), then each rank reads what it needs, resharded
to whatever layout it now has, through `trainer.safe_load`: nothing in a checkpoint is unpickled
by anything that could run code.
"""

from __future__ import annotations

import contextlib
import copy
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from infra.digest import sha256_file
from infra.store.door import DoorFenced
from infra.store.protocol import ObjectStore, fetch_verified
from trainer import safe_load
from trainer.checkpoint_manifest import FOLDER_CONTENTS, CheckpointFile, CheckpointManifest
from trainer.checkpoint_staging import own_share, stager_for
from trainer.errors import CheckpointError
from trainer.local_copies import LocalCopies
from trainer.manifest import (
    CommitOutcome,
    Fences,
    checkpoint_prefix,
    commit_fenced,
    delete_unless_fenced,
    manifest_key,
    prune,
)
from trainer.peer_tier import PeerTier, send_to_peer, write_peer_manifest
from trainer.rollback_points import RollbackPoints
from trainer.safe_load import METADATA_FILE, UnsafeCheckpoint
from trainer.typed_exchange import all_gather_typed, broadcast_typed

# The checkpoint's key for what a script keeps beside its model and optimizer (`extra`).
KEPT_STATE = "state"


def _files_written_by(folder: Path, rank: int) -> list[Path]:
    # DCP's file writer names each rank's data files `__<rank>_<n>.distcp`; the coordinator
    # (rank 0) also writes the global `.metadata`.
    files = sorted(folder.glob(f"__{rank}_*.distcp"))
    if rank == 0:
        files.append(folder / METADATA_FILE)
    return files


# What a checkpoint whose param groups are lists holds (`flat_optimizer` off): the first
# group's parameter names.
LISTED_PARAM_GROUPS = "optim.param_groups.0.params"


def _training_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict | None,
    flat_optimizer: bool = False,
) -> dict:
    """What a checkpoint holds, as DCP saves and loads it. `flat_optimizer`: the optimizer's
    param groups one item a parameter (`optim.param_groups.<name>.lr`, ...) instead of one
    list of every group. A pipeline's ranks hold different parameters, so their lists differ,
    and DCP keeps one rank's copy of an item all ranks save: the list of the first stage's
    parameters would be every stage's on load. One item a parameter is right for any layout;
    checkpoints of data and tensor parallelism keep the list they always had."""
    options = StateDictOptions(flatten_optimizer_state_dict=flat_optimizer)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state: dict = {"model": model_state, "optim": optim_state}
    if extra:
        state[KEPT_STATE] = extra
    return state


def _replicas_only(layout: dict) -> bool:
    """Every rank holds the whole state: data parallelism alone (no shard, no tensor split,
    no pipeline stages)."""
    split = ("shard", "tensor", "pipeline")
    return all(layout.get(degree, 1) == 1 for degree in split)


@dataclass
class SaveReport:
    step: int
    manifest_key: str | None  # None: nothing of this save was committed (fenced, or `lost`)
    stall_s: float  # time the training loop was blocked by this save
    total_s: float  # from the save call to the commit
    fenced: bool = False  # a later generation has started: nothing was committed
    lost: str | None = None  # why this generation's own key at this step held another manifest
    peer: bool = False  # a peer-tier checkpoint (trainer.peer_tier), not the store's


class Checkpointer:
    """Saves in the background, one at a time; every rank calls every method (collectives)."""

    def __init__(
        self,
        *,
        store: ObjectStore,
        staging_dir: Path,
        run_id: str,
        generation: int,
        keep: int,
        layout: dict,
        asynchronous: bool = True,
        run_uid: str = "",
        local_copies: LocalCopies | None = None,
        prunes_local_copies: bool = False,
        peer: PeerTier | None = None,
    ) -> None:
        self.store = store
        self.peer = peer  # None: this run takes no peer-tier checkpoints
        # Where this rank keeps the files of its last commit for the node's next generation
        # (None: deleted after the upload); one rank a node prunes the older ones.
        self.local_copies = local_copies
        self.prunes_local_copies = prunes_local_copies
        self.staging_dir = staging_dir
        self.run_id = run_id
        self.run_uid = run_uid  # in every manifest; fences and pruning see only this run's
        self.generation = generation
        self.fenced = False  # set once a save found this generation superseded
        self.keep = keep
        self._verified: set[str] = set()  # checkpoints pruning found whole: checked once
        self.layout = layout
        self.asynchronous = asynchronous
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._group = dist.new_group(backend="gloo")
        self._stager = stager_for(torch.cuda.is_available())
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-commit")
        self._staged: Future | None = None
        self._in_flight: Future | None = None
        self._stall_s = 0.0
        # Rank 0 commits: it keeps what a corruption verdict may roll back to.
        self.rollback_points = RollbackPoints(store, run_id, generation) if self.rank == 0 else None

    def save(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        step: int,
        meta: dict,
        *,
        peer: bool = False,
        extra: dict | None = None,
    ) -> SaveReport | None:
        """Start a checkpoint of the current state once the previous one has committed (one
        save in flight); returns that previous save's report if it had to wait for it. With
        `peer`, a peer-tier checkpoint: to the node and its peer, not the store. `extra`: the
        script's own state by name (`forgeline.kept_state`), saved beside the model's."""
        if peer and self.peer is None:
            raise ValueError("a peer-tier save needs the Checkpointer's `peer`")
        started = time.perf_counter()
        previous = self.wait()
        folder = self.staging_dir / f"step-{step}"
        folder.mkdir(parents=True, exist_ok=True)
        state = _training_state(model, optimizer, extra, self.layout.get("pipeline", 1) > 1)
        if _replicas_only(self.layout) and self.world > 1:
            state = own_share(state, self.rank, self.world)  # staged once a node, not per rank
        if self.asynchronous:
            response = dcp.async_save(
                state,
                checkpoint_id=str(folder),
                process_group=self._group,
                async_stager=self._stager,
            )
            self._staged = response.staging_completion
            written: Future = response.upload_completion
        else:
            dcp.save(state, checkpoint_id=str(folder), process_group=self._group)
            written = Future()
            written.set_result(None)
        self._stall_s = time.perf_counter() - started
        # The manifest is written later, in the background: freeze what it says about now.
        frozen = copy.deepcopy(meta)
        commit = self._commit_peer if peer else self._commit
        self._in_flight = self._committer.submit(commit, written, folder, step, frozen, started)
        return previous

    @property
    def busy(self) -> bool:
        """A save is still on its way to its commit."""
        return self._in_flight is not None and not self._in_flight.done()

    @property
    def group(self) -> dist.ProcessGroup:
        """The gloo group checkpoints use (the peer tier's restore uses it too)."""
        return self._group

    def before_weights_change(self) -> None:
        """Call before optimizer.step(): the staged copy must be complete by then."""
        if self._staged is not None:
            started = time.perf_counter()
            self._staged.result()
            self._staged = None
            self._stall_s += time.perf_counter() - started

    def poll(self) -> SaveReport | None:
        """The report of a save that committed since the last poll, without waiting."""
        if self._in_flight is not None and self._in_flight.done():
            return self.wait()
        return None

    def wait(self, timeout: float | None = None) -> SaveReport | None:
        """Wait for the save in flight to commit; its report, or None if none was in flight.
        With `timeout`, None too when it has not committed within that many seconds: it goes
        on in the background (a peer it needs may be gone, and its collective times out)."""
        if self._in_flight is None:
            return None
        if timeout is not None and not futures_wait([self._in_flight], timeout).done:
            return None
        self.before_weights_change()
        future, self._in_flight = self._in_flight, None
        report: SaveReport = future.result()
        report.stall_s = self._stall_s
        return report

    def close(self) -> None:
        self.wait()
        self._committer.shutdown(wait=True)
        self._stager.close()

    def _commit(
        self, written: Future, folder: Path, step: int, meta: dict, started: float
    ) -> SaveReport:
        written.result()
        prefix = checkpoint_prefix(self.run_id, step, self.generation)
        fenced = self._superseded()
        mine = []
        try:
            for path in [] if fenced else _files_written_by(folder, self.rank):
                key = f"{prefix}/{path.name}"
                self.store.put_file(key, path)
                mine.append(
                    CheckpointFile(
                        name=path.name, key=key, bytes=path.stat().st_size,
                        sha256=sha256_file(path),
                    )
                )  # fmt: skip
        except DoorFenced:  # the agent found the fence first (a rank paused since it looked)
            fenced = True
        gathered = all_gather_typed((fenced, mine), tuple[bool, list[CheckpointFile]], self._group)
        fenced = any(part[0] for part in gathered if part is not None)
        key: str | None = None
        lost: str | None = None
        if self.rank == 0:
            fenced = fenced or self._superseded()  # once more, just before the commit
            if not fenced:
                key, lost = self._write_manifest(step, meta, gathered)
                fenced = key is None and lost is None  # taken back: fenced after all
        verdict = (key, fenced, lost) if self.rank == 0 else None  # rank 0's, for every rank
        key, fenced, lost = broadcast_typed(
            verdict, tuple[str | None, bool, str | None], 0, self._group
        )
        if fenced:  # what this rank uploaded will never be named by a manifest
            delete_unless_fenced(self.store, (entry.key for entry in mine))
        elif key is not None and self.local_copies is not None:
            self.local_copies.keep([(folder / entry.name, entry.sha256) for entry in mine])
            if self.prunes_local_copies:
                wanted = {e.sha256 for part in gathered if part for e in part[1]}
                self.local_copies.prune(wanted)
        shutil.rmtree(folder, ignore_errors=True)
        self.fenced = self.fenced or fenced
        return SaveReport(step, key, 0.0, time.perf_counter() - started, fenced, lost)

    def _write_manifest(
        self, step: int, meta: dict, gathered: list
    ) -> tuple[str | None, str | None]:
        """The commit: the manifest, last, create-if-absent, at this generation's own key. Its
        key and None; or None and why another manifest already held the key (only a writer of
        this same generation can have put one there: the store's copy stands); or None, None
        when the commit was taken back because a newer generation had resumed meanwhile."""
        files = [entry for part in gathered for entry in (part[1] if part else [])]
        manifest = self._manifest(step, meta, files)
        key = manifest_key(self.run_id, step, self.generation)
        outcome = commit_fenced(
            self.store, key, manifest, self.run_id, self.run_uid, self.generation, step
        )
        if outcome is CommitOutcome.ALREADY_THERE:
            return None, f"{key} was already there (another writer of generation {self.generation})"
        if outcome is CommitOutcome.TAKEN_BACK:  # its files go too: nothing stale stays
            delete_unless_fenced(self.store, (entry.key for entry in manifest.files))
            return None, None
        # A boxed rank's door refuses a generation superseded since its commit every write and
        # delete: the commit stands, the newer generation prunes, and this one's next save
        # finds the fence and stops.
        with contextlib.suppress(DoorFenced):
            if self.rollback_points is not None:
                self.rollback_points.committed(key, step)
            prune(self.store, self.run_id, self.keep, self._verified, self.run_uid)
        return key, None

    def _manifest(self, step: int, meta: dict, files: list[CheckpointFile]) -> CheckpointManifest:
        """What a manifest of either tier says: the run, the step, the layout, the loop's
        state (`meta`: tokens, data cursor, losses), the generation, every file."""
        return CheckpointManifest.model_validate(
            {
                "run_id": self.run_id,
                "run_uid": self.run_uid,
                "step": step,
                "world_size": self.world,
                "layout": self.layout,
                "committed_at": datetime.now(UTC).isoformat(),
                **meta,
                "generation": self.generation,
                "files": files,
            }
        )

    def _commit_peer(
        self, written: Future, folder: Path, step: int, meta: dict, started: float
    ) -> SaveReport:
        """A peer-tier commit: every rank sends its files to its counterpart on the node's peer
        (trainer.peer_tier), then rank 0 writes the peer manifest. Nothing goes to the store
        but that manifest."""
        assert self.peer is not None
        written.result()
        fenced = any(all_gather_typed(self._superseded(), bool, self._group))
        key: str | None = None
        if not fenced:
            mine = [
                (path, CheckpointFile(name=path.name, bytes=path.stat().st_size,
                                      sha256=sha256_file(path)))
                for path in _files_written_by(folder, self.rank)
            ]  # fmt: skip
            files = send_to_peer(self.peer, mine, self._group)
            if self.rank == 0:
                key = write_peer_manifest(
                    self.store, self._manifest(step, meta, files), self.run_id, step,
                    self.generation, self.run_uid,
                )  # fmt: skip
                fenced = key is None
            verdict = (key, fenced) if self.rank == 0 else None
            key, fenced = broadcast_typed(verdict, tuple[str | None, bool], 0, self._group)
            if key is not None and self.peer.local_rank == 0:
                self.peer.holdings.prune({entry.sha256 for entry in files})
        shutil.rmtree(folder, ignore_errors=True)
        self.fenced = self.fenced or fenced
        return SaveReport(step, key, 0.0, time.perf_counter() - started, fenced, peer=True)

    def _superseded(self) -> bool:
        return Fences.read(self.store, self.run_id, self.run_uid).superseded(self.generation)


def fetch_checkpoint(
    store: ObjectStore,
    manifest: CheckpointManifest,
    dest: Path,
    local_copies: LocalCopies | None = None,
) -> Path:
    """Every file of a committed checkpoint in `dest`, each checked by sha256: this node's own
    copy where it has one (`local_copies`), else downloaded."""
    dest.mkdir(parents=True, exist_ok=True)
    for entry in manifest.files:
        local = local_path(dest, entry.name)
        if local_copies is not None and local_copies.place(entry, local):
            continue
        fetch_verified(store, entry.key, local, entry.sha256, entry.bytes)
    return dest


def vet_metadata(store: ObjectStore, manifest: CheckpointManifest) -> None:
    """Refuse (UnsafeCheckpoint) a committed checkpoint whose DCP metadata would run code when
    unpickled, before any rank is started on it: resume then falls back to the one before, as
    it does for a file whose hash is wrong. (Items are vetted when the ranks load them.) A
    script's own folder (trainer.folder_checkpoint) holds no DCP metadata, whatever its
    files are named: its script reads them, not Forgeline."""
    if manifest.contents == FOLDER_CONTENTS:
        return
    for entry in manifest.files:
        if entry.name == METADATA_FILE:
            safe_load.check_metadata(store.get_bytes(entry.key), entry.key)


def local_path(dest: Path, name: object) -> Path:
    """Where a manifest's file lands: a plain name inside `dest`, never a path out of it (the
    manifest is read from the store, and a crafted one could name ../../.bashrc)."""
    if not isinstance(name, str) or not safe_load.is_plain_file_name(name):
        raise UnsafeCheckpoint(f"refusing checkpoint file name {name!r}: not a plain file name")
    return dest / name


def load_training_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    folder: Path,
    extra: dict | None = None,
) -> None:
    """Restore model and optimizer in place from a fetched checkpoint, resharded to this layout;
    and `extra`, the script's own state by name as it is now (its template: tensors are loaded
    into it, other values replaced), with what the checkpoint holds of it."""
    flat = LISTED_PARAM_GROUPS not in safe_load.read_metadata(folder).state_dict_metadata
    state = _training_state(model, optimizer, extra, flat)
    if extra:
        _check_kept_state(extra, folder)
    safe_load.load(state, folder)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=StateDictOptions(flatten_optimizer_state_dict=flat),
    )


def _check_kept_state(extra: dict, folder: Path) -> None:
    """DCP loads what the template names: a name the checkpoint lacks would load nothing, and
    a value the template has no room for would be dropped, each without a word. Say so."""
    saved = set(safe_load.read_metadata(folder).state_dict_metadata)
    wanted = set(flatten_state_dict({KEPT_STATE: extra})[0])
    for name in extra:
        prefix = f"{KEPT_STATE}.{name}."
        ours = {key for key in wanted if key.startswith(prefix)}
        theirs = {key for key in saved if key.startswith(prefix)}
        if ours and not theirs:
            raise CheckpointError(
                f"the checkpoint in {folder} holds no state {name!r}: its run saved none under "
                "that name (run.restore(state=...) must name what the run's checkpoints keep)"
            )
        if extra_keys := sorted(theirs - ours):
            raise CheckpointError(
                f"the checkpoint in {folder} holds {', '.join(extra_keys[:3])} of state "
                f"{name!r}, for which its state_dict() now has no place: its state_dict() must "
                "have the same keys before and after training starts"
            )


def load_model_weights(model: torch.nn.Module, folder: Path) -> None:
    """Restore only the model's weights, in a plain process (no process group needed)."""
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        # Loading without a process group is the point here, not a mistake to warn about.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        safe_load.load(state, folder)
    model.load_state_dict(state["model"])


def load_model_state(folder: Path) -> dict[str, torch.Tensor]:
    """The model's weights of a fetched checkpoint as a flat state dict, without the model's
    class (a user's script owns it): shapes and dtypes come from the vetted DCP metadata."""
    return load_saved_tensors(folder, "model")


def load_saved_tensors(folder: Path, under: str) -> dict[str, torch.Tensor]:
    """Every tensor a fetched checkpoint holds under `under` (`model`, or `state.<name>` for a
    script's own state), whole, by its name below it, in a plain process."""
    prefix = f"{under}."
    metadata = safe_load.read_metadata(folder)
    template = {
        key.removeprefix(prefix): torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and hasattr(entry, "size")
    }
    state = {under: template}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        safe_load.load(state, folder)
    return state[under]
