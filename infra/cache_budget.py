"""A node-local cache kept to a byte budget: what it holds, how big each entry is and when a job
last used it, so that a fetch that would go over the budget first evicts what was used longest
ago, and never what a running job holds.

The cache's layout (activities.fetch.NodeCache) has four kinds of entries, each evicted whole:
`blobs/<sha256>` (a dataset shard or tokenizer), `checkpoints/<folder of a manifest key>` (the
plain files a checkpoint's manifest lists, directly in that folder), `code/<snapshot id>` (a
user's code snapshot, a tree) and `envs/<key>` (a Python environment built for a code folder's
requirements, infra.user_envs; a tree whose links, to the node's interpreter, are not counted).
The index (`index.json`, written atomically) only adds the order of use and which dataset
snapshots are held whole; sizes are always read from the disk when the cache opens, so a missing
or corrupt index costs the order of use, never a wrong size or a file nobody accounts for.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

T = TypeVar("T")
INDEX = "index.json"
GB = 1_000_000_000
# Without a setting, a cache may use this share of its disk: the rest is left to the jobs'
# staging, logs and metric spools, and to other caches (the local stack runs several agents on
# one disk).
DEFAULT_DISK_SHARE = 0.25
_SHA256 = re.compile(r"[0-9a-f]{64}")
# Kinds of entries that are trees of files, evicted as one folder.
TREES = ("code", "envs")

log = logging.getLogger(__name__)


class Entry(BaseModel):
    bytes: int
    # The index's use counter when a job last fetched or verified the entry: eviction goes by it
    # (wall-clock time can tie, or jump back); 0 for what was found on disk but not in the index.
    used: int = 0
    used_at: float = 0.0  # when, for people reading the index
    # When it was brought in from outside (0: found on disk by an index that did not know it);
    # a job that found it here leaves this as it was: a node that held what a run needed
    # fetched nothing, which this records.
    fetched_at: float = 0.0


class HeldSnapshot(BaseModel):
    """A dataset snapshot counts as held while every blob it was fetched as still is."""

    blobs: list[str]
    used: int = 0


class CacheIndex(BaseModel):
    counter: int = 0
    entries: dict[str, Entry] = {}
    snapshots: dict[str, HeldSnapshot] = {}
    # Entries the cluster wants kept (its hot pool's base models): room is made from the others
    # first, least recently used first, and only then from these.
    hot: list[str] = []


def default_budget(root: Path) -> int:
    """A share of the disk the cache is (or will be) on."""
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return int(shutil.disk_usage(probe).total * DEFAULT_DISK_SHARE)


class CacheBudget:
    """The index of one cache folder and its pins; safe to share between threads (the control
    worker evaluates and registers on several at once). One process per cache folder."""

    def __init__(self, root: Path, budget_bytes: int) -> None:
        self.root = root
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._pins: Counter[str] = Counter()  # entry -> leases holding it
        self._dirty = False
        self._index = self._load()

    # --- what jobs do ----------------------------------------------------------------------

    def lease(self) -> CacheLease:
        return CacheLease(self)

    def held_snapshots(self) -> list[str]:
        """The dataset snapshots held whole, most recently used first."""
        with self._lock:
            held = self._index.snapshots.items()
            return [s for s, _ in sorted(held, key=lambda item: (-item[1].used, item[0]))]

    def held_whole(self) -> list[tuple[str, int]]:
        """What a run could find here whole, most recently used first: each dataset snapshot
        (by id, its blobs' bytes together) and each checkpoint (by its entry,
        `checkpoints/<store folder>`)."""
        with self._lock:
            entries = self._index.entries
            found = [
                (snapshot, sum(entries[b].bytes for b in held.blobs), held.used)
                for snapshot, held in self._index.snapshots.items()
            ]
            found += [
                (rel, entry.bytes, entry.used)
                for rel, entry in entries.items()
                if rel.startswith("checkpoints/")
            ]
        return [(key, size) for key, size, _ in sorted(found, key=lambda f: (-f[2], f[0]))]

    def keep_hot(self, rels: Iterable[str]) -> None:
        """Mark exactly `rels` as hot (what was hot and is not named goes back to plain LRU)."""
        with self._lock:
            hot = sorted(set(rels) & self._index.entries.keys())
            if hot != self._index.hot:
                self._index.hot = hot
                self._dirty = True

    def entry(self, rel: str) -> Entry | None:
        """What the index records of `rel` (a copy)."""
        with self._lock:
            found = self._index.entries.get(rel)
            return None if found is None else found.model_copy()

    def hold_snapshot(self, snapshot_id: str, blobs: Iterable[str]) -> None:
        """Record that `blobs` (entries already in the cache) are `snapshot_id`'s files."""
        with self._lock:
            known = self._index.snapshots.get(snapshot_id)
            wanted = set(blobs) | set(known.blobs if known else [])
            if not wanted <= self._index.entries.keys():
                return  # a blob left meanwhile (another thread's eviction): not held whole
            self._index.counter += 1
            self._index.snapshots[snapshot_id] = HeldSnapshot(
                blobs=sorted(wanted), used=self._index.counter
            )
            self._dirty = True

    def used_bytes(self) -> int:
        with self._lock:
            return self._total()

    def save(self) -> None:
        """Write the index if it changed (atomically: a crash leaves the old one or the new)."""
        with self._lock:
            if not self._dirty:
                return
            tmp = self.root / f".{INDEX}.tmp"
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                tmp.write_text(self._index.model_dump_json())
                os.replace(tmp, self.root / INDEX)
            except OSError:  # a full disk: the next open rebuilds the index; the job goes on
                log.warning("cache %s: could not write its index", self.root, exc_info=True)
                return
            self._dirty = False

    # --- used by leases ----------------------------------------------------------------------

    def _pin(self, rel: str) -> None:
        with self._lock:
            self._pins[rel] += 1

    def _unpin(self, rels: Iterable[str]) -> None:
        with self._lock:
            self._pins.subtract(rels)
            self._pins = +self._pins  # drop the zeros

    def _admit(
        self, rel: str, expected_bytes: int, fetch: Callable[[], T], quiet: bool
    ) -> tuple[T, bool]:
        """Make room for `rel` (pinned by the caller), fetch it outside the lock (a download
        never blocks the other threads), then record its size on disk and this use. What
        `fetch` returned, and whether the cache went over its budget (logged unless `quiet`)."""
        with self._lock:
            held = self._index.entries.get(rel)
            needed = max(0, expected_bytes - (held.bytes if held else 0))
            over = not self._make_room(needed, rel)
            if over and not quiet:
                self._say_over(needed, rel)
        try:
            value = fetch()
        finally:  # also after a failed fetch: whatever it left on disk is accounted for
            with self._lock:
                size = _size_of(self.root, rel)
                if size is None:
                    self._forget(rel)
                else:
                    self._index.counter += 1
                    now = time.time()
                    self._index.entries[rel] = Entry(
                        bytes=size, used=self._index.counter, used_at=now,
                        fetched_at=held.fetched_at if held else now,
                    )  # fmt: skip
                    if size > expected_bytes:  # bigger than announced: room after the fact
                        over = not self._make_room(0, rel) or over
                self._dirty = True
        return value, over

    # --- internals (under the lock) ----------------------------------------------------------

    def _total(self) -> int:
        return sum(entry.bytes for entry in self._index.entries.values())

    def _make_room(self, needed: int, for_rel: str) -> bool:
        """Evict what no lease holds until `needed` more bytes fit: what is not hot first, then
        what is, each least recently used first; whether they fit."""
        total = self._total()
        if total + needed <= self.budget_bytes:
            return True
        hot = set(self._index.hot)
        by_value = sorted(
            self._index.entries.items(),
            key=lambda item: (item[0] in hot, item[1].used, item[1].used_at, item[0]),
        )
        for rel, entry in by_value:
            if total + needed <= self.budget_bytes:
                return True
            if self._pins[rel] or rel == for_rel:
                continue
            _remove(self.root, rel)
            self._forget(rel)
            total -= entry.bytes
            log.info("cache %s: evicted %s (%d bytes, least recently used%s)", self.root, rel,
                     entry.bytes, ", hot" if rel in hot else "")  # fmt: skip
        return total + needed <= self.budget_bytes

    def _say_over(self, needed: int, for_rel: str) -> None:
        # A job must run: what the running jobs hold cannot go, so the cache goes over.
        pinned = sum(e.bytes for r, e in self._index.entries.items() if self._pins[r])
        log.warning(
            "cache %s: over its budget of %d bytes to fetch %s (%d bytes more): the running "
            "jobs' own entries alone take %d bytes; fetching anyway (raise "
            "FORGELINE_NODE_CACHE_GB, or run smaller jobs on this node; said once a job)",
            self.root, self.budget_bytes, for_rel, needed, pinned,
        )  # fmt: skip

    def _forget(self, rel: str) -> None:
        self._index.entries.pop(rel, None)
        if rel in self._index.hot:
            self._index.hot = [h for h in self._index.hot if h != rel]
        self._index.snapshots = {
            s: held for s, held in self._index.snapshots.items() if rel not in held.blobs
        }
        self._dirty = True

    def _load(self) -> CacheIndex:
        """The index as recorded, checked against what is on disk: sizes from the disk, what
        the index does not know adopted as least recently used, what is gone dropped."""
        recorded = CacheIndex()
        path = self.root / INDEX
        try:
            recorded = CacheIndex.model_validate_json(path.read_bytes())
        except FileNotFoundError:
            pass
        except (OSError, ValidationError) as err:
            log.warning("cache %s: index unreadable (%s): rebuilding it from the disk",
                        self.root, str(err).splitlines()[0])  # fmt: skip
        entries: dict[str, Entry] = {}
        for rel, (size, mtime) in _scan(self.root).items():
            known = recorded.entries.get(rel)
            entries[rel] = known.model_copy(update={"bytes": size}) if known \
                else Entry(bytes=size, used=0, used_at=mtime)  # fmt: skip
        snapshots = {
            s: held for s, held in recorded.snapshots.items() if set(held.blobs) <= entries.keys()
        }
        counter = max([recorded.counter, *(e.used for e in entries.values())])
        hot = [rel for rel in recorded.hot if rel in entries]
        index = CacheIndex(counter=counter, entries=entries, snapshots=snapshots, hot=hot)
        self._dirty = index != recorded
        return index


class LeaseClosed(RuntimeError):
    """A lease was used after it closed (a fetch outliving its cancelled job)."""


class CacheLease:
    """What one job uses, pinned until the lease closes: eviction to make room for another
    job's fetch never takes files from under running ranks."""

    def __init__(self, budget: CacheBudget) -> None:
        self.budget = budget
        self._held: set[str] = set()
        self._closed = False
        self._said_over = False  # once a job: a dataset of 10,000 shards is one line, not 10,000

    def admit(self, rel: str, expected_bytes: int, fetch: Callable[[], T]) -> T:
        """Bring entry `rel` in with `fetch` (or verify it), pinned for the lease's life."""
        if self._closed:
            # A fetch still running in a thread after its job was cancelled: stop it here,
            # rather than pin what nobody will ever unpin.
            raise LeaseClosed(f"{rel}: the job this cache lease was for has ended")
        if rel not in self._held:
            self.budget._pin(rel)
            self._held.add(rel)
        value, over = self.budget._admit(rel, expected_bytes, fetch, quiet=self._said_over)
        self._said_over = self._said_over or over
        return value

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.budget._unpin(self._held)
            self.budget.save()

    def __enter__(self) -> CacheLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- the layout on disk ----------------------------------------------------------------------


def _size_of(root: Path, rel: str) -> int | None:
    """An entry's bytes on disk; None when it is not there at all."""
    path = root / rel
    kind = rel.split("/", 1)[0]
    try:
        if kind == "blobs":
            return path.stat().st_size if path.is_file() else None
        if not path.is_dir():
            return None
        if kind == "checkpoints":
            return sum(f.stat().st_size for f in _plain_files(path))
        return _tree_bytes(path)[0]
    except FileNotFoundError:
        return None


def _tree_bytes(folder: Path) -> tuple[int, float]:
    """The bytes of a tree's files and its newest modification time; links are not its
    bytes (an environment's interpreter is a link to the node's)."""
    stats = [f.lstat() for f in folder.rglob("*") if f.is_file() and not f.is_symlink()]
    newest = max((s.st_mtime for s in stats), default=folder.stat().st_mtime)
    return sum(s.st_size for s in stats), newest


def _plain_files(folder: Path) -> list[Path]:
    return [f for f in folder.iterdir() if f.is_file() and not f.is_symlink()]


def _remove(root: Path, rel: str) -> None:
    path = root / rel
    kind = rel.split("/", 1)[0]
    try:
        if kind == "blobs":
            path.unlink(missing_ok=True)
        elif kind == "checkpoints":
            # Only the checkpoint's own files: an older layout's step folder can hold a
            # generation's folder, which is an entry of its own.
            for file in _plain_files(path):
                file.unlink(missing_ok=True)
            _prune_empty(path, root / "checkpoints")
        elif kind == "envs":
            # Out of its name first: a removal cut short never leaves a folder under the
            # environment's name (its record is what says it is whole, but this is cheaper).
            gone = path.with_name(f".evicted-{path.name}-{uuid.uuid4().hex[:8]}")
            os.rename(path, gone)
            shutil.rmtree(gone, ignore_errors=True)
        else:
            shutil.rmtree(path, ignore_errors=True)
    except OSError:
        log.warning("cache %s: could not remove all of %s", root, rel, exc_info=True)


def _prune_empty(folder: Path, stop: Path) -> None:
    while folder != stop and stop in folder.parents:
        try:
            folder.rmdir()
        except OSError:  # not empty (another checkpoint below or beside), or gone
            return
        folder = folder.parent


def _scan(root: Path) -> dict[str, tuple[int, float]]:
    """Every entry on disk: relative path -> (bytes, modification time)."""
    found: dict[str, tuple[int, float]] = {}
    blobs = root / "blobs"
    if blobs.is_dir():
        for file in blobs.iterdir():
            if file.is_file() and _SHA256.fullmatch(file.name):
                stat = file.stat()
                found[f"blobs/{file.name}"] = (stat.st_size, stat.st_mtime)
            elif file.is_file():  # a download cut short by a crash: no fetch runs yet
                file.unlink(missing_ok=True)
    for kind in TREES:
        if (root / kind).is_dir():
            for folder in (root / kind).iterdir():
                if folder.name.startswith("."):
                    # An environment's build or eviction cut short by a crash (its lock files
                    # are empty and stay): no job runs yet.
                    if folder.is_dir():
                        shutil.rmtree(folder, ignore_errors=True)
                elif folder.is_dir():
                    found[f"{kind}/{folder.name}"] = _tree_bytes(folder)
    checkpoints = root / "checkpoints"
    if checkpoints.is_dir():
        for folder, _dirs, _files in os.walk(checkpoints):
            files = _plain_files(Path(folder))
            if files:
                rel = Path(folder).relative_to(root).as_posix()
                stats = [f.stat() for f in files]
                found[rel] = (sum(s.st_size for s in stats), max(s.st_mtime for s in stats))
    return found
