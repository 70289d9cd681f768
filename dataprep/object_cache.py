"""Read a planned source through a local copy of exactly the planned version: a local file's
checked against its planned sha256 as it is copied, an object's fetched by its ETag.

The data worker that scans a chunk may share no file system with the CLI or the planner, so it
fetches each object it reads into a cache folder of its own (the worker's state folder), keyed
by bucket, key and ETag: a changed object is a new entry, fetched again, and an unchanged one is
fetched once, whichever snapshot needs it. The existing readers then read the copy, and what
they report (documents, bad records, errors) names the object's URL, never the cache path.

The plan lists each object with its ETag and the snapshot id is named after it, so the fetch
asks for exactly that version; an object replaced or deleted since then fails the scan with a
message that names it, rather than feeding new content into a snapshot named for the old.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path, PurePosixPath

from dataprep.documents import Document, ReadStats
from dataprep.errors import DataprepError, SourceChangedError
from dataprep.plan import PlannedFile
from dataprep.readers import ReaderSettings, read_source
from dataprep.remote_sources import Sites
from dataprep.source_urls import S3_SCHEME
from dataprep.sources import SourceFile
from infra.errors import ObjectChanged, ObjectNotFound

_SAFE = re.compile(r"[A-Za-z0-9-]{1,64}")
_COPY_BLOCK = 1 << 20
_SAFE_SUFFIX = re.compile(r"(\.[A-Za-z0-9]{1,16}){1,2}")
_AGAIN = (
    "prepare the data again (`forgeline data prepare SPEC`, or submit the run again) so that a "
    "new snapshot is planned over what is there now"
)


class SourceReader:
    """Documents of planned sources; objects come from the cache under `cache`."""

    def __init__(self, cache: Path, sites: Sites | None = None) -> None:
        self.cache = cache
        self._sites = sites or Sites()

    def documents(
        self, planned: PlannedFile, settings: ReaderSettings, stats: ReadStats
    ) -> Iterator[Document]:
        if not planned.is_object:
            # Read a copy checked against the planned sha256, never the path itself: the
            # snapshot id names that content, and the path may hold other bytes by now.
            copy = self.verified_file(planned)
            try:
                yield from _named(planned, copy, settings, stats)
            finally:
                _remove(copy)
            return
        yield from _named(planned, self.local_copy(planned), settings, stats)

    def verified_file(self, planned: PlannedFile) -> Path:
        """A private copy of a planned local file, made while hashing it, that has exactly the
        content it was planned with (SourceChangedError naming it otherwise). Private: chunks
        scanned at once may read the same file; the caller deletes it once read."""
        (self.cache / "files").mkdir(parents=True, exist_ok=True)
        dest = Path(tempfile.mkdtemp(dir=self.cache / "files")) / _name(planned.path)
        digest = hashlib.sha256()
        try:
            with open(planned.path, "rb") as source, open(dest, "wb") as out:
                while block := source.read(_COPY_BLOCK):
                    digest.update(block)
                    out.write(block)
            if digest.hexdigest() != planned.sha256:
                raise SourceChangedError(
                    f"source {planned.path} changed after this snapshot was planned (sha256 "
                    f"{digest.hexdigest()[:12]}… now, {planned.sha256[:12]}… planned, and the "
                    f"snapshot id names that content): {_AGAIN}"
                )
        except FileNotFoundError:
            _remove(dest)
            raise SourceChangedError(
                f"source {planned.path} was deleted after this snapshot was planned: restore "
                f"it, or {_AGAIN}"
            ) from None
        except BaseException:
            _remove(dest)
            raise
        return dest

    def local_copy(self, planned: PlannedFile) -> Path:
        """The cached copy of the planned version of an object, fetched if not there yet."""
        from infra.store.s3_objects import ObjectInfo

        bucket, _, key = planned.path.removeprefix(S3_SCHEME).partition("/")
        dest = self.cache / "s3" / bucket / _hashed(key) / _etag_dir(planned.etag) / _name(key)
        # Copies land whole (renamed into place after their check), so one of the listed size
        # is the verified version: an ETag names one content.
        if dest.is_file() and dest.stat().st_size == planned.bytes:
            return dest
        objects = self._sites.bucket(bucket, planned.options)
        try:
            objects.download(ObjectInfo(key, planned.bytes, planned.etag), dest)
        except ObjectChanged:
            raise SourceChangedError(
                f"source {planned.path} changed after this snapshot was planned (it was listed "
                f"with ETag {planned.etag}, and the snapshot id names that content): {_AGAIN}"
            ) from None
        except ObjectNotFound:
            raise SourceChangedError(
                f"source {planned.path} was deleted after this snapshot was planned: restore it, "
                f"or {_AGAIN}"
            ) from None
        return dest


def _named(
    planned: PlannedFile, local: Path, settings: ReaderSettings, stats: ReadStats
) -> Iterator[Document]:
    """The readers' output for the copy at `local`, named by the object's URL."""
    url, own = planned.path, ReadStats()
    copy = SourceFile(str(local), planned.format, planned.language)  # type: ignore[arg-type]
    try:
        for doc in read_source(copy, settings, own):
            yield replace(doc, source=url)
    except DataprepError as err:
        raise type(err)(str(err).replace(str(local), url)) from None
    finally:
        own.examples = [replace(bad, source=url) for bad in own.examples]
        stats.merge(own)


def _remove(copy: Path) -> None:
    copy.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        copy.parent.rmdir()


def _hashed(key: str) -> str:
    # Keys may be 1,024 bytes of anything; a file name may be 255 and not every byte.
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def _etag_dir(etag: str) -> str:
    bare = etag.strip('"')
    return bare if _SAFE.fullmatch(bare) else hashlib.sha256(etag.encode()).hexdigest()[:32]


def _name(key: str) -> str:
    """A file name that keeps the key's extension: readers tell .gz (and nothing else) by it."""
    suffixes = PurePosixPath(key).suffixes
    for last in (2, 1):
        suffix = "".join(suffixes[-last:])
        if _SAFE_SUFFIX.fullmatch(suffix):
            return f"object{suffix}"
    return "object"
