"""`data.sources` that name objects, not files: `s3://bucket/…` and `store:…`, and their globs.

    s3://bucket/key                 one object
    s3://bucket/prefix/             every object under the prefix (also without the '/', when
                                    no object is named exactly that)
    s3://bucket/prefix/**/*.jsonl   a glob on the keys, with the rules of local globs
    …?endpoint=URL&profile=NAME     where and as whom (as store URLs take them); never a secret
    store:corpus/web/               a key, prefix or glob in the run's own store (FORGELINE_STORE)

`store:` is followed by a key exactly as the store's tools write it after the store's prefix (no
leading '/', no host): it names a place relative to a store the data worker already has, so it
must not look like a URL with a location of its own, and a lab that uploads a corpus once next to
its snapshots can point at it without repeating the bucket, endpoint or profile in every spec.

Keys are matched component by component as local paths are (dataprep/sources.py): `*` and `?`
stay within one component, `**` spans any number of them, wildcards and prefixes skip hidden
(".name") and tool folders. A '?' starts the URL's options only when a name and '=' follow it
(`?endpoint=`), so `part-?.jsonl` stays a glob.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from dataprep.errors import SourceError
from dataprep.sources import GLOB_MAGIC, visible
from infra.redact import has_credentials, redact_url

S3_SCHEME = "s3://"
STORE_SCHEME = "store:"
# As S3 names buckets (and the loose rule of legacy ones): no URL syntax, and never "." or "..".
_BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# Options start at a '?' followed by a name and '=' (a glob's '?' never is); which names are
# allowed is infra.store.s3's check, so a misspelt one is refused, not matched as a key.
_OPTIONS = re.compile(r"\?([A-Za-z_]+=.*)\Z", re.DOTALL)
CREDENTIALS_GO_TO = (
    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the data workers' environment, or an AWS "
    "profile (?profile=NAME)"
)


def is_remote(source: str) -> bool:
    """Whether a data.sources entry names objects (resolved by no local folder)."""
    return source.startswith((S3_SCHEME, STORE_SCHEME))


@dataclass(frozen=True)
class S3Source:
    """One s3:// entry of data.sources: a bucket, a key pattern and the URL's options."""

    bucket: str
    pattern: str  # a key, a prefix or a glob; "" is the whole bucket
    options: str = ""  # what followed '?', as written: endpoint=URL&profile=NAME

    @property
    def written(self) -> str:
        """As the user wrote it, for messages (without the options: they name no object)."""
        return f"{S3_SCHEME}{self.bucket}/{self.pattern}"


def parse_s3(source: str) -> S3Source:
    location, query = source, ""
    if match := _OPTIONS.search(source):
        location, query = source[: match.start()], match[1]
    _refuse_credentials(location)  # first: every later message quotes the location
    options = _checked_options(location, query) if query else {}
    _refuse_credentials(location, options.get("endpoint", ""))
    bucket, _, pattern = location.removeprefix(S3_SCHEME).partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise SourceError(
            f"source {location} has no valid bucket: write s3://bucket/key, s3://bucket/prefix/ "
            "or s3://bucket/prefix/*.jsonl (a bucket is letters, digits, '.', '_' and '-')"
        )
    return S3Source(bucket, pattern, query)


def _refuse_credentials(location: str, endpoint: str = "") -> None:
    """A source URL never carries a secret: plans, manifests and messages all name it."""
    authority = "/".join(location.split("/", 3)[:3])  # s3://user:secret@bucket
    if has_credentials(authority):
        shown = redact_url(location)
    elif has_credentials(endpoint):
        shown = f"{location}?endpoint={redact_url(endpoint)}"
    else:
        return
    raise SourceError(
        f"source {shown} carries credentials: remove them from the URL in data.sources and "
        f"put them in {CREDENTIALS_GO_TO}"
    )


def _checked_options(location: str, query: str) -> dict[str, str]:
    # The store's own check, so a source URL takes exactly what a store URL takes.
    from infra.errors import StoreError
    from infra.store.s3 import url_options

    try:
        return url_options(query, f"source {location}")
    except StoreError as err:
        raise SourceError(f"{err} (in data.sources)") from None


def store_key(source: str) -> str:
    """The key (or prefix, or glob) of a `store:` source, checked: relative, no '..' part."""
    key = source.removeprefix(STORE_SCHEME)
    if not key or key.startswith("/") or ".." in key.split("/"):
        raise SourceError(
            f"source {source!r} is not a key of the run's store: write store:KEY, "
            "store:PREFIX/ or store:PREFIX/*.jsonl (relative to the store, no '..')"
        )
    return key


def resolve_store(source: str, store_url: str) -> str:
    """A `store:` source as the s3:// URL or local path it names in the store at `store_url`
    (the data worker's own store, which is the run's)."""
    key = store_key(source)
    if not store_url:
        raise SourceError(
            f"source {source} names an object of the run's store, but no store is configured "
            "here: set FORGELINE_STORE or start the local stack"
        )
    if not store_url.startswith(S3_SCHEME):
        # The trailing '/' a prefix may end in means nothing to a folder.
        return os.path.abspath(os.path.join(store_url.removeprefix("file://"), key))
    location, query = store_url, ""
    if match := _OPTIONS.search(store_url):
        location, query = store_url[: match.start()], match[0]
    return f"{location.rstrip('/')}/{key}{query}"


def is_glob(pattern: str) -> bool:
    return GLOB_MAGIC.search(pattern) is not None


def literal_prefix(pattern: str) -> str:
    """The part of a key glob before its first wildcard: what to list under."""
    match = GLOB_MAGIC.search(pattern)
    return pattern if match is None else pattern[: match.start()]


def below(names: Sequence[str]) -> bool:
    """Whether a key found under a matched prefix belongs to it: no hidden or tool folder or
    name on the way, as a local folder's walk skips them."""
    return all(visible(name, "*") for name in names)


def key_matches(parts: Sequence[str], names: Sequence[str]) -> bool:
    """Whether the key with components `names` matches the glob with components `parts`, by
    the rules of dataprep.sources._glob (a matched folder takes everything below it)."""
    if not parts:
        return below(names)
    if not names:
        return False
    head, rest = parts[0], parts[1:]
    if head == "**":
        if not rest:
            return below(names)
        # Zero folders, or one more visible folder (a key with more components below it).
        return key_matches(rest, names) or (
            len(names) > 1 and visible(names[0], "*") and key_matches(parts, names[1:])
        )
    if not is_glob(head):
        return names[0] == head and key_matches(rest, names[1:])
    return (
        visible(names[0], head)
        and fnmatch.fnmatchcase(names[0], head)
        and key_matches(rest, names[1:])
    )
