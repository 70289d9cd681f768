"""Object store in an S3 bucket (AWS S3 or an S3-compatible server), through boto3.

The S3 semantics this store relies on, and what it adds where they fall short:

- Strong read-after-write consistency (AWS since December 2020, MinIO, moto): once a PUT
  returns, every GET, HEAD and LIST sees it, so a manifest written last is seen after its files.
- A PUT is atomic: a reader sees the old object or the new one, never a mix, and a multipart
  upload becomes visible only when it completes. No temporary key and rename are needed.
- Conditional create: PutObject with `If-None-Match: *` writes the key, or answers 412
  PreconditionFailed when it exists, atomically among concurrent writers (AWS since August 2024).
  That is `put_if_absent`, the manifest commit. Servers without it answer 501/400 or ignore the
  header; `put_if_absent` detects that once and falls back (see there for the limit).
- User metadata comes back with HEAD and with GET, in the same response as the bytes. Every put
  stores the content's sha256 as `x-amz-meta-sha256`, and a GET's bytes are checked against the
  hash of that very object version. The metadata is a claim (any writer can set any hash), so
  `digest` streams and hashes the bytes; `claimed_digest` is the one HEAD, for callers that
  hash the bytes when they fetch them anyway.
- Flexible checksums (`x-amz-checksum-sha256`): the server checks the upload against it and
  refuses a body damaged in transit. They guard one transfer; the metadata sha256 guards the
  content end to end, whatever the server does with checksum headers.
- The ETag of a multipart upload is not a content hash (it ends in "-<parts>"), so hashes never
  come from ETags; an ETag only pins the ranged GETs of one download to one object version.
- HEAD has no body, so its 404 does not say whether the key or the bucket is missing: one
  HeadBucket, on that path only, tells them apart.
- DeleteObject of a missing key succeeds, and ListObjectsV2 pages (1,000 keys at most) in
  UTF-8 binary order with a continuation token.

Endpoint, region and credentials come only from boto3's standard chain (AWS_ENDPOINT_URL[_S3],
AWS_REGION, AWS_ACCESS_KEY_ID..., AWS_PROFILE, instance roles): Forgeline's own settings never
hold a secret, and no message of this module names one.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import socket
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import parse_qs, urlsplit

import boto3
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
)
from s3transfer.exceptions import RetriesExceededError
from s3transfer.subscribers import BaseSubscriber

from infra.digest import sha256_file
from infra.errors import (
    IntegrityError,
    InvalidKey,
    ObjectNotFound,
    StoreError,
)
from infra.store.protocol import validate_key
from infra.store.s3_errors import (
    CONDITIONAL_CONFLICT,
    NO_CONDITIONAL_WRITES,
    NOT_FOUND,
    PRECONDITION_FAILED,
    error_code,
    no_bucket,
    store_error,
    without_userinfo,
)

MiB = 1 << 20
# The metadata field (x-amz-meta-sha256) that holds the hex sha256 of an object's content.
SHA256_META = "sha256"
DEFAULT_TRANSFER = TransferConfig(
    multipart_threshold=8 * MiB, multipart_chunksize=8 * MiB, max_concurrency=8
)
# Same scratch-name prefix as LocalStore's in-flight files: no valid key starts with it, so the
# conditional-write probe can never collide with a real key and is never listed.
_SCRATCH_PREFIX = ".tmp-"
_CHUNK = MiB
# Loose on purpose (legacy and S3-compatible buckets break AWS's newer naming rules): it only
# keeps URL syntax out, and the server judges the rest.
_BUCKET = re.compile(r"^[A-Za-z0-9._-]+$")

# The options an s3:// URL may carry after '?': where and as whom, never a secret.
URL_OPTIONS = frozenset({"endpoint", "region", "profile"})
_CONFLICT_ATTEMPTS = 3  # tries of a conditional put that meets a concurrent one


def client_config(max_pool_connections: int = 10, max_attempts: int = 5) -> Config:
    """botocore settings for every S3 client this store creates."""
    # S3 throttles (503 SlowDown) and drops connections under load as a matter of course; the
    # "standard" mode retries those and 5xx with capped exponential backoff and jitter, and its
    # retry quota keeps a dead endpoint from turning into a retry storm. The timeouts bound a hung
    # connection, which would otherwise stall a checkpoint upload, and its heartbeat, for good.
    return Config(
        retries={"max_attempts": max_attempts, "mode": "standard"},
        connect_timeout=10,
        read_timeout=60,
        # One connection per concurrent part, or transfers queue for the pool.
        max_pool_connections=max_pool_connections,
    )


@dataclass(frozen=True)
class _Head:
    size: int
    etag: str
    sha256: str | None


class _KnownObject(BaseSubscriber):
    """Hands our HEAD's size and ETag to s3transfer: it skips a HEAD of its own, and its ranged
    GETs carry If-Match, so every part comes from the version whose sha256 we check against."""

    def __init__(self, head: _Head) -> None:
        self._head = head

    def on_queued(self, future: Any, **kwargs: Any) -> None:
        future.meta.provide_transfer_size(self._head.size)
        future.meta.provide_object_etag(self._head.etag)


class S3Store:
    """An object store under `s3://bucket/prefix`; see the module docstring for the semantics."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        client: Any | None = None,
        *,
        conditional_writes: bool | None = None,
        transfer_config: TransferConfig = DEFAULT_TRANSFER,
        page_size: int = 1000,
    ) -> None:
        """`conditional_writes`: None probes the server once; False forces the fallback."""
        if not _BUCKET.match(bucket):
            # Not echoed: a mistyped URL may carry user:password@ where the bucket belongs.
            raise StoreError(
                "the S3 bucket name is missing or not valid: use s3://bucket/prefix with a "
                "bucket of letters, digits, '.', '_' and '-'"
            )
        prefix = prefix.strip("/")
        self.bucket = bucket
        self.prefix = validate_key(prefix) if prefix else ""
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._location = self.url  # without the options `from_url` may add to `url`
        self._root = f"{self.prefix}/" if self.prefix else ""
        self._client = (
            client if client is not None else _default_client(transfer_config.max_concurrency)
        )
        self._endpoint = without_userinfo(self._client.meta.endpoint_url)
        self._transfer_config = transfer_config
        self._page_size = page_size
        self._conditional_writes = conditional_writes
        self._bucket_seen = False
        # AWS_REQUEST_CHECKSUM_CALCULATION=when_required (or the profile setting) is how users
        # tell boto3 their server rejects checksum headers: honour it here too.
        self._send_checksums = (
            getattr(self._client.meta.config, "request_checksum_calculation", None)
            != "when_required"
        )

    @classmethod
    def from_url(cls, url: str, **options: Any) -> S3Store:
        """Open `s3://bucket[/prefix][?endpoint=URL&region=R&profile=P]`. The options are for a
        second site (a twin bucket on another server or in another region) that the process-wide
        AWS variables do not describe; credentials still come from the standard chain."""
        parts = urlsplit(url)
        if parts.scheme != "s3" or parts.fragment:
            raise StoreError("the store URL is not of the form s3://bucket/prefix")
        query = url_options(parts.query, "the store URL")
        if "client" not in options and query:
            options["client"] = client_for(query)
        store = cls(parts.netloc, parts.path, **options)
        if parts.query:  # kept, so that open_store(store.url) reaches the same site
            store.url = f"{store.url}?{parts.query}"
        return store

    # Writes

    def put_bytes(self, key: str, data: bytes) -> None:
        with self._errors(key):
            self._put_object(key, data)

    def put_file(self, key: str, path: Path) -> None:
        # The file is read twice (hash, then upload): cheap next to the network, and it lets the
        # hash ride in the metadata of the upload itself. Files must not change meanwhile, as
        # checkpoint shards and dataset shards do not.
        object_key = self._object_key(key)
        extra: dict[str, Any] = {"Metadata": {SHA256_META: sha256_file(path)}}
        if self._send_checksums:
            extra["ChecksumAlgorithm"] = "SHA256"  # per part, checked by the server
        with self._errors(key), self._transfers() as transfers:
            transfers.upload(str(path), self.bucket, object_key, extra).result()

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Write `data` under `key` only if nothing is there; True when this call created it."""
        with self._errors(key):
            if self._has_conditional_writes():
                return self._create(key, data)
            return self._create_unfenced(key, data)

    def delete(self, key: str) -> None:
        with self._errors(key):
            self._client.delete_object(Bucket=self.bucket, Key=self._object_key(key))

    # Reads

    def get_bytes(self, key: str) -> bytes:
        with self._errors(key):
            response = self._client.get_object(Bucket=self.bucket, Key=self._object_key(key))
            data = response["Body"].read()
        self._verify(key, response["Metadata"].get(SHA256_META), _sha256(data))
        return data

    def get_file(self, key: str, dest: Path) -> None:
        """Download to `dest`; a reader of `dest` sees the old file or the whole, checked one."""
        head = self._require(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f"{_SCRATCH_PREFIX}{dest.name}-", dir=dest.parent)
        os.close(fd)
        tmp = Path(name)
        try:
            with self._errors(key), self._transfers() as transfers:
                transfers.download(
                    self.bucket, self._object_key(key), str(tmp), subscribers=[_KnownObject(head)]
                ).result()
            self._verify(key, head.sha256, sha256_file(tmp))
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    def exists(self, key: str) -> bool:
        return self._head(key) is not None

    def reachable(self, timeout_s: float = 1.0) -> bool:
        """Whether the endpoint takes a TCP connection: one try, `timeout_s` at most. What a
        twin asks of a site it presumes down before paying botocore's retries on it. (Behind
        an HTTP proxy the endpoint may be up yet not connectable: False then only leaves the
        site presumed down until its hold-off ends.)"""
        parts = urlsplit(self._endpoint)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            with socket.create_connection((parts.hostname or "", port), timeout=timeout_s):
                return True
        except OSError:
            return False

    def digest(self, key: str) -> tuple[int, str]:
        """(size, sha256) of the object's bytes, streamed and hashed: its metadata is only what
        the writer claimed, and whoever can put an object can claim any hash."""
        with self._errors(key):  # a GET's 404 says NoSuchKey or NoSuchBucket, unlike a HEAD's
            response = self._client.get_object(Bucket=self.bucket, Key=self._object_key(key))
            return _size_and_sha256(response["Body"])

    def claimed_digest(self, key: str) -> tuple[int, str]:
        """(size, sha256) from one HEAD: the sha256 the writer put in the metadata. Objects put
        by other tools carry none and are streamed and hashed."""
        head = self._require(key)
        if head.sha256:
            return head.size, head.sha256
        return self.digest(key)

    def list(self, prefix: str) -> list[str]:
        """Every key under `prefix`, a folder-like prefix ("runs/x/"; "" for all), sorted."""
        folder = f"{validate_key(prefix.rstrip('/'))}/" if prefix.strip("/") else ""
        paginator = self._client.get_paginator("list_objects_v2")
        pages = paginator.paginate(
            Bucket=self.bucket,
            Prefix=self._root + folder,
            PaginationConfig={"PageSize": self._page_size},
        )
        with self._errors(folder):
            names = [item["Key"] for page in pages for item in page.get("Contents", [])]
        # Objects that other tools put under our prefix with names this store cannot address
        # (and the scratch key of a probe in flight) are not ours to list.
        return sorted(key for name in names if _is_key(key := name[len(self._root) :]))

    # put_if_absent

    def _has_conditional_writes(self) -> bool:
        if self._conditional_writes is None:
            self._conditional_writes = self._probe_conditional_writes()
        return self._conditional_writes

    def _probe_conditional_writes(self) -> bool:
        """Whether the server honours If-None-Match on PutObject: create a scratch key twice."""
        scratch = self._root + f"{_SCRATCH_PREFIX}conditional-write-probe-{uuid.uuid4().hex}"
        try:
            for _ in range(2):
                self._client.put_object(Bucket=self.bucket, Key=scratch, IfNoneMatch="*")
        except ClientError as exc:
            if error_code(exc) in NO_CONDITIONAL_WRITES:
                return False
            if error_code(exc) in PRECONDITION_FAILED:
                return True
            raise
        finally:
            self._client.delete_object(Bucket=self.bucket, Key=scratch)
        return False  # the second create succeeded: the server ignores the header

    def _create(self, key: str, data: bytes) -> bool:
        for _ in range(_CONFLICT_ATTEMPTS):
            try:
                self._put_object(key, data, IfNoneMatch="*")
                return True
            except ClientError as exc:
                if error_code(exc) == CONDITIONAL_CONFLICT:
                    continue
                if error_code(exc) not in PRECONDITION_FAILED:
                    raise
                # botocore retries a put whose answer was lost; the retry then meets the object
                # its own first attempt created. Same content after a retry means that was us.
                retried = exc.response.get("ResponseMetadata", {}).get("RetryAttempts", 0) > 0
                return retried and self._holds(key, data)
        raise StoreError(
            f"{self._url(key)}: other conditional writes kept conflicting "
            f"({_CONFLICT_ATTEMPTS} attempts): retry"
        )

    def _create_unfenced(self, key: str, data: bytes) -> bool:
        # Without conditional writes S3 has no atomic create: between our HEAD and our PUT another
        # writer can create the key, and the last PUT wins. The re-read narrows that window to a
        # writer landing between our PUT and the re-read, but cannot close it, so this is only
        # safe with a single writer per key. Generation fencing gives manifests exactly that: only
        # the current generation writes a step's manifest, and older ones are ignored.
        if self._head(key) is not None:
            return False
        self._put_object(key, data)
        return self._holds(key, data)

    def _holds(self, key: str, data: bytes) -> bool:
        """Whether `key` now holds exactly `data`."""
        return self.digest(key) == (len(data), _sha256(data))

    # Plumbing

    def _object_key(self, key: str) -> str:
        return self._root + validate_key(key)

    def _url(self, key: str) -> str:
        return f"{self._location}/{key}" if key else self._location

    def _put_object(self, key: str, data: bytes, **conditions: str) -> None:
        digest = hashlib.sha256(data).digest()
        checksum = {"ChecksumSHA256": base64.b64encode(digest).decode()}
        self._client.put_object(
            Bucket=self.bucket,
            Key=self._object_key(key),
            Body=data,
            Metadata={SHA256_META: digest.hex()},
            **(checksum if self._send_checksums else {}),
            **conditions,
        )

    def _head(self, key: str) -> _Head | None:
        """The object's size, ETag and recorded sha256; None when there is no such key."""
        with self._errors(key):
            try:
                response = self._client.head_object(Bucket=self.bucket, Key=self._object_key(key))
            except ClientError as exc:
                if error_code(exc) not in NOT_FOUND:
                    raise
                self._check_bucket()
                return None
        return _Head(
            size=response["ContentLength"],
            etag=response["ETag"],
            sha256=response.get("Metadata", {}).get(SHA256_META),
        )

    def _require(self, key: str) -> _Head:
        head = self._head(key)
        if head is None:
            raise ObjectNotFound(f"no object at {self._url(key)}")
        return head

    def _check_bucket(self) -> None:
        """Raise the missing-bucket error if that is why a HEAD found nothing."""
        if self._bucket_seen:
            return
        with self._errors(""):
            try:
                self._client.head_bucket(Bucket=self.bucket)
            except ClientError as exc:
                if error_code(exc) in NOT_FOUND:
                    raise no_bucket(self.bucket, self._endpoint) from None
                raise
        self._bucket_seen = True

    def _verify(self, key: str, expected: str | None, actual: str) -> None:
        if expected is not None and expected != actual:
            raise IntegrityError(
                f"{self._url(key)} is corrupt: its metadata records sha256 {expected}, "
                f"its content has sha256 {actual}"
            )

    @contextmanager
    def _transfers(self) -> Iterator[Any]:
        # A manager per call: its thread pools end with the transfer instead of outliving it.
        with create_transfer_manager(self._client, self._transfer_config) as manager:
            yield manager

    @contextmanager
    def _errors(self, key: str) -> Iterator[None]:
        """Turn botocore's errors into StoreErrors that name the object and the fix."""
        try:
            yield
        except (BotoCoreError, ClientError, RetriesExceededError) as exc:
            raise store_error(exc, self._url(key), self._endpoint, self.bucket) from exc


def url_options(query: str, what: str) -> dict[str, str]:
    """The options after '?' in an s3:// URL (`what` names the URL in the message), checked:
    at most one each of URL_OPTIONS, none empty."""
    parsed = parse_qs(query, keep_blank_values=True)
    unknown = sorted(set(parsed) - URL_OPTIONS)
    if unknown or any(len(v) != 1 or not v[0] for v in parsed.values()):
        raise StoreError(
            f"{what}'s options {sorted(parsed)} are not valid: use at most one each of "
            "endpoint=URL, region=NAME and profile=NAME after '?'"
        )
    return {name: values[0] for name, values in parsed.items()}


def client_for(options: dict[str, str]) -> Any:
    """An S3 client for the site that a URL's options (see `url_options`) name; what they leave
    out, and every credential, comes from boto3's standard chain."""
    return _default_client(
        DEFAULT_TRANSFER.max_concurrency,
        endpoint=options.get("endpoint"),
        region=options.get("region"),
        profile=options.get("profile"),
    )


def _default_client(
    max_concurrency: int,
    endpoint: str | None = None,
    region: str | None = None,
    profile: str | None = None,
) -> Any:
    try:
        # A session of its own: boto3's default session is shared and not thread-safe.
        return boto3.session.Session(profile_name=profile, region_name=region).client(
            "s3",
            endpoint_url=endpoint,
            config=client_config(max_pool_connections=max(10, max_concurrency)),
        )
    except (BotoCoreError, ValueError) as exc:
        raise StoreError(
            f"cannot set up an S3 client ({exc}): check AWS_ENDPOINT_URL and AWS_REGION"
        ) from exc


def _is_key(name: str) -> bool:
    try:
        validate_key(name)
    except InvalidKey:
        return False
    return True


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _size_and_sha256(stream: BinaryIO) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    while chunk := stream.read(_CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()
