"""Objects that other tools put in a bucket, read as they are (a corpus uploaded with `aws s3`).

`S3Store` addresses only keys it could have written itself and trusts the sha256 it records in
each object's metadata; a corpus has neither. This lists any key with its size and ETag, and
downloads one version of an object: the GET carries `If-Match: <ETag>`, so an object replaced
since it was listed is refused by the server (412) instead of being read under the old ETag.

An ETag is the MD5 of the content for a plain single-part upload without KMS or customer-key
encryption; then the download is checked against it. A multipart upload's ETag ends in
"-<parts>" and hashes the parts' hashes, and an encrypted object's is opaque: for those only the
size is checked, and `If-Match` still pins the version.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from infra.errors import IntegrityError, ObjectChanged, ObjectNotFound
from infra.store.s3_errors import NOT_FOUND, PRECONDITION_FAILED, error_code, store_error
from infra.store.s3_errors import without_userinfo as endpoint_label

_CHUNK = 1 << 20
_PLAIN_MD5 = re.compile(r'"?([0-9a-fA-F]{32})"?')
# With these the ETag is not the content's MD5 (S3's documentation of the ETag).
_OPAQUE_ENCRYPTION = frozenset({"aws:kms", "aws:kms:dsse"})
_SCRATCH_PREFIX = ".tmp-"


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str  # as S3 returns it, quotes included


class S3Objects:
    """Read-only access to the objects of one bucket, whatever their keys."""

    def __init__(self, bucket: str, client: Any, page_size: int = 1000) -> None:
        self.bucket = bucket
        self._client = client
        self._endpoint = endpoint_label(client.meta.endpoint_url)
        self._page_size = page_size

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with `prefix` (a plain string prefix), sorted by key."""
        paginator = self._client.get_paginator("list_objects_v2")
        pages = paginator.paginate(
            Bucket=self.bucket, Prefix=prefix, PaginationConfig={"PageSize": self._page_size}
        )
        with self._errors(prefix):
            found = [
                ObjectInfo(item["Key"], item["Size"], item.get("ETag", ""))
                for page in pages
                for item in page.get("Contents", [])
            ]
        return sorted(found, key=lambda o: o.key)

    def download(self, obj: ObjectInfo, dest: Path) -> None:
        """Write exactly the listed version of `obj` to `dest`, whole or not at all.

        Raises ObjectChanged when the key holds another version now, ObjectNotFound when it is
        gone, IntegrityError when the bytes are not the listed size (or MD5)."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f"{_SCRATCH_PREFIX}{dest.name}-", dir=dest.parent)
        tmp = Path(name)
        try:
            with os.fdopen(fd, "wb") as out, self._errors(obj.key):
                response = self._get(obj)
                md5 = hashlib.md5(usedforsecurity=False)  # only to compare with the ETag
                size = 0
                body = response["Body"]
                while chunk := body.read(_CHUNK):
                    out.write(chunk)
                    md5.update(chunk)
                    size += len(chunk)
            self._verify(obj, response, size, md5.hexdigest())
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    def _get(self, obj: ObjectInfo) -> dict:
        try:
            return self._client.get_object(Bucket=self.bucket, Key=obj.key, IfMatch=obj.etag)
        except ClientError as exc:
            code = error_code(exc)
            if code in PRECONDITION_FAILED:
                raise ObjectChanged(
                    f"{self.url(obj.key)} is no longer the version with ETag {obj.etag}"
                ) from None
            if code in NOT_FOUND:
                raise ObjectNotFound(f"no object at {self.url(obj.key)}") from None
            raise

    def _verify(self, obj: ObjectInfo, response: dict, size: int, md5: str) -> None:
        if size != obj.size:
            raise IntegrityError(
                f"{self.url(obj.key)} came down as {size} bytes, but its listing says {obj.size}"
            )
        plain = _PLAIN_MD5.fullmatch(obj.etag)
        encrypted = (
            response.get("ServerSideEncryption") in _OPAQUE_ENCRYPTION
            or "SSECustomerAlgorithm" in response
        )
        if plain and not encrypted and plain[1].lower() != md5:
            raise IntegrityError(
                f"{self.url(obj.key)} came down with MD5 {md5}, but its ETag is {obj.etag}"
            )

    @contextmanager
    def _errors(self, key: str) -> Iterator[None]:
        """botocore's errors as StoreErrors that name the object; a missing bucket says so
        without the store's own fix (this bucket is not the run's store), and holds no object."""
        try:
            yield
        except ClientError as exc:
            if error_code(exc) == "NoSuchBucket":
                raise ObjectNotFound(
                    f"S3 bucket {self.bucket!r} does not exist at {self._endpoint}"
                ) from None
            raise store_error(exc, self.url(key), self._endpoint, self.bucket) from exc
        except BotoCoreError as exc:
            raise store_error(exc, self.url(key), self._endpoint, self.bucket) from exc
