"""Expand the object sources of `data.sources` (s3://…, store:…) into typed, versioned objects.

A listing gives every object's size and ETag without reading it, so planning a snapshot of a
remote corpus costs one LIST per thousand objects, not a download of the corpus: the size and
ETag are what name the object in the snapshot id (see dataprep/plan.py), and the read later
fetches exactly that version (dataprep/object_cache.py).

`store:` sources are resolved against the store of the process that expands them; on a local
store they are local paths, read and hashed like any other file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dataprep.errors import SourceError
from dataprep.source_urls import (
    S3_SCHEME,
    STORE_SCHEME,
    S3Source,
    below,
    is_glob,
    key_matches,
    literal_prefix,
    parse_s3,
    resolve_store,
)
from dataprep.sources import Matches, SourceFile, classify, unknown_extension
from infra.errors import StoreError, StoreUnavailable

if TYPE_CHECKING:  # boto3 is imported only where an s3:// source is read
    from infra.store.s3_objects import ObjectInfo, S3Objects


@dataclass(frozen=True)
class ObjectSource:
    source: SourceFile  # its path is the object's URL, s3://bucket/key
    size: int
    etag: str
    options: str  # the options of the URL it was found through (endpoint=…&profile=…)


class Sites:
    """One S3 client per set of URL options, made on first use and shared by every bucket."""

    def __init__(self) -> None:
        self._clients: dict[str, object] = {}

    def bucket(self, bucket: str, options: str) -> S3Objects:
        from infra.store.s3 import client_for, url_options
        from infra.store.s3_objects import S3Objects

        if options not in self._clients:
            where = f"{S3_SCHEME}{bucket}"
            try:
                self._clients[options] = client_for(url_options(options, where))
            except StoreError as err:  # e.g. a profile that is not there: no retry helps
                raise SourceError(f"source {where}: {err}") from None
        return S3Objects(bucket, self._clients[options])


def split_sources(patterns: list[str], store_url: str) -> tuple[list[str], list[S3Source]]:
    """The local patterns (with `store:` sources of a local store among them) and the s3 ones."""
    local: list[str] = []
    remote: list[S3Source] = []
    for pattern in patterns:
        if pattern.startswith(STORE_SCHEME):
            pattern = resolve_store(pattern, store_url)
        if pattern.startswith(S3_SCHEME):
            remote.append(parse_s3(pattern))
        else:
            local.append(pattern)
    return local, remote


def expand_objects(sources: list[S3Source], sites: Sites | None = None) -> list[ObjectSource]:
    """Every object the sources name, deduplicated and sorted by URL (then options)."""
    sites = sites or Sites()
    found: dict[tuple[str, str], ObjectSource] = {}
    for source in sources:
        for obj in _expand_one(source, sites.bucket(source.bucket, source.options)):
            found[obj.source.path, obj.options] = obj
    return [found[k] for k in sorted(found)]


def _expand_one(source: S3Source, objects: S3Objects) -> list[ObjectSource]:
    pattern = source.pattern
    try:
        listed = objects.list(literal_prefix(pattern))
    except StoreUnavailable:
        raise  # transient: the data worker's activity retries
    except StoreError as err:
        raise SourceError(f"source {source.written} cannot be listed: {err}") from None
    # A key ending in '/' is a console's "folder" marker, not a document.
    listed = [o for o in listed if not o.key.endswith("/")]
    # An existing key wins over glob syntax, as an existing path does for local sources.
    exact = [o for o in listed if o.key == pattern]
    if exact:
        url = objects.url(pattern)
        if (typed := classify(url)) is None:
            raise unknown_extension(url)
        return [_typed(typed, exact[0], source)]
    if is_glob(pattern):
        parts = pattern.rstrip("/").split("/")
        chosen = [o for o in listed if key_matches(parts, o.key.split("/"))]
    else:
        folder = pattern if not pattern or pattern.endswith("/") else f"{pattern}/"
        chosen = [
            o for o in listed if o.key.startswith(folder) and below(o.key[len(folder) :].split("/"))
        ]
    matches = Matches()
    by_url = {objects.url(o.key): o for o in chosen}
    for url in by_url:
        matches.take(url)
    if not matches.files:
        raise matches.nothing_error(source.written, "objects")
    return [_typed(typed, by_url[typed.path], source) for typed in matches.files]


def _typed(typed: SourceFile, obj: ObjectInfo, source: S3Source) -> ObjectSource:
    if not obj.etag:
        raise SourceError(
            f"the S3 server listed {typed.path} without an ETag, so a change to it could not be "
            "told: use a server that returns ETags"
        )
    return ObjectSource(typed, obj.size, obj.etag, source.options)
