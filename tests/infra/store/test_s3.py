"""S3Store against a real S3-compatible HTTP server (moto) on loopback.

Nothing in boto3 is mocked: every call goes over HTTP to moto's S3. Where a test needs a server
that behaves differently (one that ignores or refuses If-None-Match, or a lost answer), a botocore
event hook on the client changes what goes over the wire, and says so.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from boto3.s3.transfer import TransferConfig
from botocore.awsrequest import AWSResponse
from botocore.exceptions import ConnectionClosedError
from botocore.httpsession import URLLib3Session

from infra.errors import IntegrityError, InvalidKey, ObjectNotFound, StoreError
from infra.store.factory import open_store
from infra.store.local import LocalStore
from infra.store.protocol import (
    ObjectStore,
    check_claimed_files,
    fetch_verified,
    verify_stored_files,
)
from infra.store.s3 import SHA256_META, MiB, S3Store
from tests.infra.conftest import new_client

PREFIX = "team/store"
# S3 (and moto) refuse parts under 5 MiB except the last: the smallest multipart upload there is.
SMALL_PARTS = TransferConfig(
    multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, max_concurrency=4
)


@dataclass(frozen=True)
class ListedFile:
    """A file as a manifest lists it."""

    key: str
    bytes: int
    sha256: str


def s3_store(bucket: str, **options: Any) -> S3Store:
    return S3Store(bucket, PREFIX, transfer_config=SMALL_PARTS, **options)


@pytest.fixture
def s3(bucket: str) -> S3Store:
    return s3_store(bucket)


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    """Both stores, so that the behaviour contract cannot drift between them."""
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    return s3_store(request.getfixturevalue("bucket"))


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def scratch_files(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.startswith(".tmp-")]


# The contract, on both stores


def test_put_get_list_delete(store: ObjectStore) -> None:
    """Read-after-write, folder-like prefix listing in key order, HEAD digest, idempotent delete."""
    store.put_bytes("runs/a/x.bin", b"hello")
    store.put_bytes("runs/a/sub/y.bin", b"world")
    store.put_bytes("runs/ab/z.bin", b"!")
    assert store.get_bytes("runs/a/x.bin") == b"hello"
    assert store.exists("runs/a/x.bin")
    assert store.digest("runs/a/x.bin") == (5, sha(b"hello"))
    assert store.list("runs/a/") == ["runs/a/sub/y.bin", "runs/a/x.bin"]
    assert store.list("runs/a") == store.list("runs/a/")
    assert store.list("runs/a/x") == []  # a prefix is a folder, not the start of a name
    assert store.list("") == ["runs/a/sub/y.bin", "runs/a/x.bin", "runs/ab/z.bin"]
    store.put_bytes("runs/a/x.bin", b"hello again")  # a put replaces
    assert store.get_bytes("runs/a/x.bin") == b"hello again"
    store.delete("runs/a/x.bin")
    store.delete("runs/a/x.bin")  # deleting a missing key is not an error
    assert not store.exists("runs/a/x.bin")
    assert store.list("runs/a/") == ["runs/a/sub/y.bin"]


def test_put_if_absent_creates_once(store: ObjectStore) -> None:
    """Create-if-absent (If-None-Match: * on S3): the second writer is refused, the first stays."""
    assert store.put_if_absent("m/MANIFEST.json", b"first")
    assert not store.put_if_absent("m/MANIFEST.json", b"second")
    assert not store.put_if_absent("m/MANIFEST.json", b"first")  # even with the same bytes
    assert store.get_bytes("m/MANIFEST.json") == b"first"
    assert store.list("") == ["m/MANIFEST.json"]  # no scratch or probe keys are left behind


def test_missing_key(store: ObjectStore, tmp_path: Path) -> None:
    """GET 404 NoSuchKey and HEAD 404 both mean ObjectNotFound, naming the key; HEAD → exists."""
    assert not store.exists("d/none.bin")
    for read in (
        lambda: store.get_bytes("d/none.bin"),
        lambda: store.get_file("d/none.bin", tmp_path / "out" / "none.bin"),
        lambda: store.digest("d/none.bin"),
    ):
        with pytest.raises(ObjectNotFound, match=r"d/none\.bin"):
            read()
    assert not (tmp_path / "out" / "none.bin").exists()


@pytest.mark.parametrize("key", ["../x", "a//b", "/abs", "a/.tmp-x", ""])
def test_invalid_keys_are_rejected_before_any_request(store: ObjectStore, key: str) -> None:
    """Keys are validated locally: S3 would accept "../x" and "a//b" as distinct, odd names."""
    for call in (
        lambda: store.put_bytes(key, b"x"),
        lambda: store.put_if_absent(key, b"x"),
        lambda: store.get_bytes(key),
        lambda: store.exists(key),
        lambda: store.delete(key),
    ):
        with pytest.raises(InvalidKey, match="not allowed"):
            call()


def test_file_round_trip_replaces_dest_whole(store: ObjectStore, tmp_path: Path) -> None:
    """Single-part upload and download; dest is replaced by rename, no scratch file remains."""
    source = tmp_path / "in.bin"
    source.write_bytes(b"shard" * 1000)
    store.put_file("d/shard.bin", source)
    dest = tmp_path / "cache" / "deep" / "shard.bin"
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"stale")
    store.get_file("d/shard.bin", dest)
    assert dest.read_bytes() == source.read_bytes()
    assert store.digest("d/shard.bin") == (5000, sha(source.read_bytes()))
    assert scratch_files(dest.parent) == []


def test_fetch_verified(store: ObjectStore, tmp_path: Path) -> None:
    """fetch_verified over either store: downloads once, and refuses bytes of another hash."""
    store.put_bytes("d/shard.bin", b"0123456789")
    dest = tmp_path / "cache" / "shard.bin"
    assert fetch_verified(store, "d/shard.bin", dest, sha(b"0123456789"), 10) == dest
    assert dest.read_bytes() == b"0123456789"
    dest.unlink()
    with pytest.raises(IntegrityError, match=r"d/shard\.bin is corrupt"):
        fetch_verified(store, "d/shard.bin", dest, sha(b"0123456780"), 10)
    assert not dest.exists()


# S3 only


def test_large_file_goes_multipart_both_ways(s3: S3Store, raw: Any, tmp_path: Path) -> None:
    """Multipart upload (ETag "<md5>-<parts>", not a content hash) with per-part checksums and
    the sha256 in metadata; ranged parallel download pinned by If-Match; both verified."""
    data = os.urandom(12 * MiB)
    source = tmp_path / "big.bin"
    source.write_bytes(data)
    s3.put_file("ckpt/big.bin", source)

    head = raw.head_object(Bucket=s3.bucket, Key=f"{PREFIX}/ckpt/big.bin")
    assert head["ETag"].strip('"').endswith("-3")  # 5 + 5 + 2 MiB
    assert head["Metadata"][SHA256_META] == sha(data)
    assert s3.digest("ckpt/big.bin") == (len(data), sha(data))

    dest = tmp_path / "out" / "big.bin"
    s3.get_file("ckpt/big.bin", dest)
    assert dest.read_bytes() == data
    assert scratch_files(dest.parent) == []


def test_digest_of_an_object_without_our_metadata(s3: S3Store, raw: Any, tmp_path: Path) -> None:
    """Objects put by other tools have no x-amz-meta-sha256: digest streams and hashes them,
    and reads return them unchecked (there is nothing to check against)."""
    data = b"written by another tool" * 100
    raw.put_object(Bucket=s3.bucket, Key=f"{PREFIX}/ext/data.bin", Body=data)
    assert s3.digest("ext/data.bin") == (len(data), sha(data))
    assert s3.get_bytes("ext/data.bin") == data
    s3.get_file("ext/data.bin", tmp_path / "data.bin")
    assert (tmp_path / "data.bin").read_bytes() == data


def test_digest_hashes_the_bytes_not_the_writers_claim(s3: S3Store, raw: Any) -> None:
    """Anyone who can put an object can put any sha256 in its metadata. Before, digest returned
    that claim, so the content checks (`forgeline lineage`) passed bytes that were swapped:
    now digest hashes what is stored, and only claimed_digest, asked for by name, trusts it."""
    s3.put_bytes("d/shard.bin", b"good")
    swapped = {"Bucket": s3.bucket, "Key": f"{PREFIX}/d/shard.bin", "Body": b"evil"}
    raw.put_object(**swapped, Metadata={SHA256_META: sha(b"good")})
    assert s3.digest("d/shard.bin") == (4, sha(b"evil"))
    assert s3.claimed_digest("d/shard.bin") == (4, sha(b"good"))
    file = ListedFile(key="d/shard.bin", bytes=4, sha256=sha(b"good"))
    check_claimed_files(s3, [file], "shard")  # the claim matches: this check cannot tell
    found = sha(b"evil")[:12]
    with pytest.raises(IntegrityError, match=rf"shard d/shard\.bin is corrupt.*{found}"):
        verify_stored_files(s3, [file], "shard")


def test_tampered_object_is_refused(s3: S3Store, raw: Any, tmp_path: Path) -> None:
    """GET returns bytes and metadata of one version: content that no longer matches its
    recorded sha256 raises IntegrityError naming the key and both hashes, and lands nowhere."""
    s3.put_bytes("d/shard.bin", b"good")
    raw.put_object(
        Bucket=s3.bucket,
        Key=f"{PREFIX}/d/shard.bin",
        Body=b"evil",
        Metadata={SHA256_META: sha(b"good")},
    )
    expected = rf"d/shard\.bin is corrupt.*{sha(b'good')}.*{sha(b'evil')}"
    with pytest.raises(IntegrityError, match=expected):
        s3.get_bytes("d/shard.bin")
    dest = tmp_path / "shard.bin"
    with pytest.raises(IntegrityError, match=expected):
        s3.get_file("d/shard.bin", dest)
    assert not dest.exists()
    assert scratch_files(tmp_path) == []


def test_put_if_absent_fallback_without_conditional_writes(bucket: str) -> None:
    """HEAD-then-PUT-then-reread, the single-writer fallback for servers without If-None-Match."""
    store = s3_store(bucket, conditional_writes=False)
    assert store.put_if_absent("m/MANIFEST.json", b"first")
    assert not store.put_if_absent("m/MANIFEST.json", b"second")
    assert store.get_bytes("m/MANIFEST.json") == b"first"


def test_probe_detects_a_server_that_ignores_if_none_match(bucket: str) -> None:
    """A server (or proxy) that drops If-None-Match would let a second create overwrite: here the
    client never sends the header, and the probe must notice and pick the fallback."""

    def drop_if_none_match(params: dict[str, Any], **_: Any) -> None:
        params.pop("IfNoneMatch", None)

    client = new_client()
    client.meta.events.register("provide-client-params.s3.PutObject", drop_if_none_match)
    store = s3_store(bucket, client=client)
    assert store.put_if_absent("m/MANIFEST.json", b"first")
    assert not store.put_if_absent("m/MANIFEST.json", b"second")
    assert store.get_bytes("m/MANIFEST.json") == b"first"
    assert store.list("") == ["m/MANIFEST.json"]


class _Body:
    def __init__(self, data: bytes) -> None:
        self._data = data

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self._data


def test_probe_detects_a_server_that_answers_501(bucket: str) -> None:
    """A server without conditional writes answers 501 NotImplemented to If-None-Match: the
    hook answers so in its place (only for those requests), and the store falls back."""
    refusal = b"<Error><Code>NotImplemented</Code><Message>If-None-Match</Message></Error>"

    def not_implemented(request: Any, **_: Any) -> AWSResponse | None:
        if "If-None-Match" in request.headers:
            return AWSResponse(request.url, 501, {}, _Body(refusal))
        return None

    client = new_client()
    client.meta.events.register("before-send.s3.PutObject", not_implemented)
    store = s3_store(bucket, client=client)
    assert store.put_if_absent("m/MANIFEST.json", b"first")
    assert not store.put_if_absent("m/MANIFEST.json", b"second")
    assert store.get_bytes("m/MANIFEST.json") == b"first"


def test_a_retried_create_that_meets_itself_is_ours(bucket: str) -> None:
    """The first conditional PUT lands but its answer is lost (the hook sends it, then drops the
    connection); botocore retries and gets 412 from our own object: that is a create, not a loss."""
    sent: list[Any] = []

    def deliver_then_drop(request: Any, **_: Any) -> None:
        if "If-None-Match" in request.headers and not sent:
            sent.append(URLLib3Session().send(request))
            raise ConnectionClosedError(endpoint_url=request.url)

    client = new_client()
    client.meta.events.register("before-send.s3.PutObject", deliver_then_drop)
    store = s3_store(bucket, client=client, conditional_writes=True)
    assert store.put_if_absent("m/MANIFEST.json", b"mine")
    assert sent[0].status_code == 200
    assert store.get_bytes("m/MANIFEST.json") == b"mine"


def test_list_pages_and_skips_foreign_names(bucket: str, raw: Any) -> None:
    """ListObjectsV2 pagination via continuation tokens; keys relative to the store's prefix;
    objects outside the prefix or with names the store cannot address are not listed."""
    client = new_client()
    pages: list[int] = []
    client.meta.events.register(
        "after-call.s3.ListObjectsV2", lambda parsed, **_: pages.append(parsed.get("KeyCount", 0))
    )
    store = s3_store(bucket, client=client, page_size=2)
    keys = [f"runs/r/step-{n}/MANIFEST.json" for n in range(5)]
    for key in keys:
        store.put_bytes(key, b"{}")
    raw.put_object(Bucket=bucket, Key=f"{PREFIX}/runs/r/odd name", Body=b"")
    raw.put_object(Bucket=bucket, Key="elsewhere/runs/r/x", Body=b"")
    assert store.list("runs/r/") == keys
    assert pages == [2, 2, 2]
    assert store.list("") == keys


def test_missing_bucket_is_named(endpoint: str, tmp_path: Path) -> None:
    """NoSuchBucket (GET, PUT, LIST) and a HEAD 404 that HeadBucket explains both name the
    bucket and the fix, instead of passing for a missing key."""
    store = s3_store(f"forgeline-absent-{uuid.uuid4().hex[:8]}")
    for call in (
        lambda: store.put_bytes("a/b", b"x"),
        lambda: store.get_bytes("a/b"),
        lambda: store.exists("a/b"),
        lambda: store.digest("a/b"),
        lambda: store.get_file("a/b", tmp_path / "b"),
        lambda: store.list(""),
        lambda: store.put_if_absent("a/b", b"x"),
    ):
        with pytest.raises(StoreError, match=rf"bucket '{store.bucket}' does not exist.*create it"):
            call()


def test_unreachable_endpoint_is_named_without_secrets(
    endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused connection is named with its endpoint and the setting to check, and no
    credential from the environment appears in the message or the store's URL."""
    with socket.socket() as sock:  # a port that was free a moment ago: nobody listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "sEcReT-do-not-print")
    store = S3Store("some-bucket", PREFIX, client=new_client(max_attempts=1))
    with pytest.raises(StoreError, match=rf"127\.0\.0\.1:{port}.*AWS_ENDPOINT_URL") as caught:
        store.put_bytes("a/b", b"x")
    for secret in ("sEcReT", "forgeline-test-key"):
        assert secret not in str(caught.value)
        assert secret not in store.url


def test_missing_credentials_say_what_to_set(bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no credentials anywhere in the chain, the error says which variables to set."""
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(StoreError, match="AWS_ACCESS_KEY_ID"):
        s3_store(bucket).put_bytes("a/b", b"x")


def test_open_store_s3_urls(endpoint: str) -> None:
    """s3://bucket[/prefix] opens an S3Store whose url is the bucket and prefix, nothing more."""
    store = open_store("s3://b/p")
    assert isinstance(store, S3Store)
    assert store.url == "s3://b/p"
    assert open_store("s3://bucket/a/b/").url == "s3://bucket/a/b"
    assert open_store("s3://bucket").url == "s3://bucket"
    with pytest.raises(StoreError, match="bucket name"):
        open_store("s3:///p")
    with pytest.raises(InvalidKey):
        open_store("s3://bucket/../p")


def test_local_stores_do_not_import_boto3(tmp_path: Path) -> None:
    """open_store imports boto3 only for s3:// URLs (it costs the local stack startup time)."""
    code = (
        "import sys; from infra.store.factory import open_store; "
        f"open_store({str(tmp_path / 's')!r}); assert 'boto3' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[3])
