"""What Forgeline needs from object storage, and which keys it may use.

One flat key space with create-if-absent puts. Three stores implement it: a local folder
(`infra/store/local.py`), an S3 bucket (`infra/store/s3.py`) and a primary with a twin site
(`infra/store/twin.py`); `infra/store/factory.py` opens the one a URL names. Keys are checked
here, once for all of them, so no key escapes a store's root or aliases another.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

from infra.digest import sha256_file
from infra.errors import IntegrityError, InvalidKey, ObjectNotFound

_KEY_PART = re.compile(r"^[A-Za-z0-9._=-]+$")
# Temporary files of in-flight writes start with this; no key may, so none is ever listed.
TMP_PREFIX = ".tmp-"


def validate_key(key: str) -> str:
    """Reject keys that could escape the store root or alias another key."""
    parts = key.split("/")
    if not key or any(
        not _KEY_PART.match(part) or part in (".", "..") or part.startswith(TMP_PREFIX)
        for part in parts
    ):
        raise InvalidKey(
            f"store key {key!r} is not allowed: use '/'-separated parts of letters, digits, "
            "'.', '_', '=', '-', none of them '.', '..' or starting with '.tmp-'"
        )
    return key


class ObjectStore(Protocol):
    """What the rest of Forgeline needs from object storage."""

    url: str

    def put_bytes(self, key: str, data: bytes) -> None: ...
    def put_file(self, key: str, path: Path) -> None: ...
    def put_if_absent(self, key: str, data: bytes) -> bool: ...
    def get_bytes(self, key: str) -> bytes: ...
    def get_file(self, key: str, dest: Path) -> None: ...
    def exists(self, key: str) -> bool: ...
    def digest(self, key: str) -> tuple[int, str]:
        """(size, sha256) of the bytes stored under `key`, hashed from those bytes: what a
        check of content asks."""
        ...

    def claimed_digest(self, key: str) -> tuple[int, str]:
        """(size, sha256) as the writer recorded it (on S3 its metadata: one HEAD, and anyone
        who can put an object can claim any hash). For callers that hash the bytes when they
        fetch them anyway (fetch_verified), or only decide whether to copy; never proof."""
        ...

    def list(self, prefix: str) -> list[str]: ...
    def delete(self, key: str) -> None: ...
    def reachable(self) -> bool:
        """Whether the site answers at all, in about a second and without retries."""
        ...


def fetch_verified(store: ObjectStore, key: str, dest: Path, sha256: str, size: int) -> Path:
    """Download `key` to `dest` unless an identical copy is there; check size and sha256."""
    if dest.is_file() and dest.stat().st_size == size and sha256_file(dest) == sha256:
        return dest
    store.get_file(key, dest)
    actual_size = dest.stat().st_size
    actual_sha = sha256_file(dest)
    if actual_size != size or actual_sha != sha256:
        dest.unlink(missing_ok=True)
        raise IntegrityError(
            f"{store.url}/{key} is corrupt: expected {size} bytes with sha256 {sha256[:12]}…, "
            f"got {actual_size} bytes with sha256 {actual_sha[:12]}…"
        )
    return dest


class Digested(Protocol):
    """A file that a manifest or record names: its key, size and sha256."""

    @property
    def key(self) -> str: ...
    @property
    def bytes(self) -> int: ...
    @property
    def sha256(self) -> str: ...


def verify_stored_files(store: ObjectStore, files: Iterable[Digested], what: str) -> None:
    """Check every file is in the store with its recorded size and sha256, hashing the stored
    bytes (IntegrityError, naming the first that is missing or differs)."""
    _compare_stored_files(store.digest, files, what)


def check_claimed_files(store: ObjectStore, files: Iterable[Digested], what: str) -> None:
    """The same against what the store claims each file holds (`claimed_digest`): a cheap check
    that every file is there and was written whole, for readers that hash the bytes when they
    fetch them (resume, pruning, a stage's done-record); not a check of content."""
    _compare_stored_files(store.claimed_digest, files, what)


def _compare_stored_files(
    digest_of: Callable[[str], tuple[int, str]], files: Iterable[Digested], what: str
) -> None:
    for entry in files:
        try:
            size, sha256 = digest_of(entry.key)
        except ObjectNotFound:
            raise IntegrityError(f"{what} {entry.key} is missing") from None
        if size != entry.bytes or sha256 != entry.sha256:
            raise IntegrityError(
                f"{what} {entry.key} is corrupt: expected {entry.bytes} bytes "
                f"with sha256 {entry.sha256[:12]}…, found {size} bytes with {sha256[:12]}…"
            )
