"""Open the object store a URL names: a folder, an S3 bucket, or either with a twin site."""

from __future__ import annotations

from pathlib import Path

from infra.errors import StoreError
from infra.store.local import LocalStore
from infra.store.protocol import ObjectStore


def open_store(url: str, twin: str = "") -> ObjectStore:
    """Open the store that `url` names: `s3://bucket/prefix`, `file:///abs/path` or a folder;
    with `twin`, a second site that stands in while it is down (infra/store/twin.py)."""
    if twin:
        from infra.store.twin import TwinStore

        return TwinStore(open_store(url), open_store(twin))
    if url.startswith("file://"):
        return LocalStore(Path(url.removeprefix("file://")))
    if url.startswith("door://"):  # a boxed rank's: through its node agent (infra.store.door)
        from infra.store.door import DoorStore

        return DoorStore.from_url(url)
    if url.startswith("s3://"):
        # Imported here: boto3 takes a while to import, and the local stack never needs it.
        from infra.store.s3 import S3Store

        return S3Store.from_url(url)
    if "://" in url:
        scheme = url.split("://", 1)[0]
        raise StoreError(
            f"store URL {url!r} uses the scheme {scheme!r}, which this build does not support: "
            "use s3://bucket/prefix, a local folder path or file:///path"
        )
    return LocalStore(Path(url))
