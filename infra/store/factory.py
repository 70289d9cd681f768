"""Open the object store a URL names: a folder, an S3 bucket, or either with a twin site."""

from __future__ import annotations

from pathlib import Path

from infra.errors import StoreError
from infra.store.door import DoorStore
from infra.store.local import LocalStore
from infra.store.protocol import ObjectStore
from infra.store.twin import TwinStore


def open_store(url: str, twin: str = "") -> ObjectStore:
    """Open the store that `url` names: `s3://bucket/prefix`, `file:///abs/path` or a folder;
    with `twin`, a second site that stands in while it is down (infra/store/twin.py)."""
    if twin:
        return TwinStore(open_store(url), open_store(twin))
    if url.startswith("file://"):
        return LocalStore(Path(url.removeprefix("file://")))
    if url.startswith("door://"):  # a boxed rank's: through its node agent (infra.store.door)
        return DoorStore.from_url(url)
    if url.startswith("s3://"):
        return _s3_store_class().from_url(url)
    if "://" in url:
        scheme = url.split("://", 1)[0]
        raise StoreError(
            f"store URL {url!r} uses the scheme {scheme!r}, which this build does not support: "
            "use s3://bucket/prefix, a local folder path or file:///path"
        )
    return LocalStore(Path(url))


def _s3_store_class() -> type[ObjectStore]:
    # Imported when first needed: boto3 takes a while to import, and the local stack never
    # needs it. The one import of a project module inside a function that a rank may run, so a
    # rank calls preload() before its user's script can take the name `infra`.
    from infra.store.s3 import S3Store

    return S3Store


def preload(url: str, twin: str = "") -> None:
    """Import now the store classes that `open_store(url, twin)` will need
    (trainer.user_module_names: a user's script may have a module `infra` of its own)."""
    for named in (url, twin):
        if named.startswith("s3://"):
            _s3_store_class()
