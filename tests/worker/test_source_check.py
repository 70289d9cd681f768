"""The API's check of a submitted spec's data.sources (worker/source_check.py): inside the data
roots only, saying nothing of what lies outside them, and off the event loop, so that a slow
listing holds up no other request. The app is asked in-process; the slow listing is a stand-in
S3 server that answers when the test lets it."""

from __future__ import annotations

import asyncio
import io
import json
import os
import tarfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from infra.processes import free_port
from infra.settings import Settings
from infra.tokens import TokenStore
from tests.asgi_call import Answer, call
from tests.http_server import serving
from worker.api import make_app
from worker.source_check import SourceCheck
from worker.specfile import SpecError, parse_spec
from workflows.contracts.cluster_models import ClusterConfig

_LISTING = (
    b'<?xml version="1.0" encoding="UTF-8"?>'
    b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
    b"<Name>corpus</Name><Prefix>web/</Prefix><KeyCount>1</KeyCount><MaxKeys>1000</MaxKeys>"
    b"<IsTruncated>false</IsTruncated><Contents><Key>web/a.txt</Key>"
    b'<LastModified>2026-01-01T00:00:00.000Z</LastModified><ETag>"0f"</ETag><Size>3</Size>'
    b"</Contents></ListBucketResult>"
)


class HeldListing:
    """An S3 server whose listing answers once the test lets it (or after 5 s)."""

    def __init__(self) -> None:
        self.asked, self.let_go, self.answered = (threading.Event() for _ in range(3))

    def handler(self) -> type[BaseHTTPRequestHandler]:
        listing = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                listing.asked.set()
                listing.let_go.wait(5)
                self.send_response(200)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(_LISTING)))
                self.end_headers()
                self.wfile.write(_LISTING)
                listing.answered.set()

            def log_message(self, *_: object) -> None:
                pass

        return Handler


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[HeldListing, str]]:
    nowhere = str(tmp_path / "absent")
    for name, value in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": nowhere,
                        "AWS_SHARED_CREDENTIALS_FILE": nowhere,
                        "AWS_EC2_METADATA_DISABLED": "true"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    listing = HeldListing()
    with serving(listing.handler()) as url:
        try:
            yield listing, f"s3://corpus/web/*.txt?endpoint={url}"
        finally:
            listing.let_go.set()


@pytest.fixture
def api(tmp_path: Path) -> tuple[object, dict[str, str], Path]:
    """The app, a submitter's headers, and its one data root."""
    root = tmp_path / "data"
    root.mkdir()
    settings = Settings(home=tmp_path / "home", temporal_address=f"127.0.0.1:{free_port()}",
                        store_url=f"file://{tmp_path / 'store'}", data_roots=str(root))  # fmt: skip
    token, _ = TokenStore(settings.home).create("alice", ["submit:research"], created_by="test")
    headers = {"authorization": f"Bearer {token}", "content-type": "application/json"}
    return make_app(settings, cluster_config=_no_lists), headers, root


async def _no_lists() -> ClusterConfig:
    """The cluster file as applied, without Temporal: no team lists its sources."""
    return ClusterConfig()


async def _submit(app, headers: dict[str, str], *sources: str) -> Answer:
    spec = {"name": "x", "data": {"sources": list(sources)}, "resources": {"team": "research"}}
    return await call(app, "POST", "/v1/runs", headers, [json.dumps({"spec": spec}).encode()])


def _refusal(api, source: str) -> str:
    app, headers, _ = api
    answer = asyncio.run(_submit(app, headers, source))
    error = answer.json()["error"]
    assert (answer.status, error["field"]) == (422, "data.sources"), answer.body
    return error["message"]


def test_a_source_outside_the_data_roots_is_refused_naming_no_file(api) -> None:
    _, _, root = api
    probes = {"/etc/ssh/*": "/nonexistent-1/*", "/etc/passwd": "/nonexistent-2",
              f"{root}/../../../etc/*": "/nonexistent-3/*"}  # fmt: skip
    for there, nowhere in probes.items():
        message = _refusal(api, there)
        assert str(root) in message and "outside the data roots" in message
        # What exists outside answers as what does not: the same words but for the name.
        shown = os.path.normpath(there)
        assert message.replace(shown, "?") == _refusal(api, nowhere).replace(nowhere, "?")
        assert "ssh_config" not in message and "root:" not in message
    # A link inside the roots that leads out of them is refused too, and names nothing there.
    (root / "link").symlink_to("/etc")
    message = _refusal(api, f"{root}/link/ssh/*")
    assert "through a link" in message and "ssh_config" not in message
    # Inside the roots the check says what it always said.
    (root / "notes.csv").write_text("a,b\n")
    message = _refusal(api, f"{root}/*")
    assert "matches no files" in message and "notes.csv" in message


def test_train_code_is_looked_for_in_the_upload_not_on_the_api_s_host(api) -> None:
    app, headers, root = api
    (root / "corpus.txt").write_text("To be.\n")
    tar = {**headers, "content-type": "application/x-tar"}
    uploaded = asyncio.run(call(app, "POST", "/v1/code", tar, [_tar("train.py")])).json()

    def submit(entrypoint: str) -> Answer:
        spec = {"name": "x", "data": {"sources": [str(root / "corpus.txt")]},
                "resources": {"team": "research"},
                "train": {"code": "/etc/ssh", "entrypoint": entrypoint}}  # fmt: skip
        body = json.dumps({"spec": spec, "code": uploaded}).encode()
        return asyncio.run(call(app, "POST", "/v1/runs", headers, [body]))

    assert submit("train.py").status == 503  # checked, on to Temporal (not there)
    answer = submit("sshd.py")
    assert answer.status == 422 and "in the code uploaded" in answer.json()["error"]["message"]


def _tar(name: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = 2
        tar.addfile(info, io.BytesIO(b"x\n"))
    return buffer.getvalue()


def test_a_slow_check_holds_up_no_other_request(api, held) -> None:
    app, headers, _ = api
    listing, source = held

    async def main() -> tuple[Answer, bool, Answer]:
        submit = asyncio.create_task(_submit(app, headers, source))
        assert await asyncio.to_thread(listing.asked.wait, 10)
        whoami = await asyncio.wait_for(call(app, "GET", "/v1/whoami", headers), 2)
        still_listing = not listing.answered.is_set()
        listing.let_go.set()
        return whoami, still_listing, await submit

    whoami, still_listing, submitted = asyncio.run(main())
    assert whoami.status == 200 and still_listing  # answered while the listing was held
    # The listing found its object, so the spec went on to Temporal, which is not there.
    assert submitted.status == 503, submitted.body


def test_the_check_is_bounded_in_time_threads_and_entries(tmp_path: Path, held) -> None:
    listing, source = held
    settings = Settings(home=tmp_path, data_roots=str(tmp_path))
    spec = parse_spec({"name": "x", "data": {"sources": [source]}}, spec_dir=None)
    check = SourceCheck(settings, threads=1, timeout_s=1.0)

    async def main() -> tuple[float, float]:
        started = time.monotonic()
        await check(spec)  # the listing never answers in time: let through, unchecked
        waited = time.monotonic() - started
        started = time.monotonic()
        await check(spec)  # its one thread still hangs on that listing: not checked at all
        return waited, time.monotonic() - started

    waited, busy = asyncio.run(main())
    # The second check does not wait out the timeout again: well under it, on a busy machine
    # too (a bound of 0.1 s against a 0.3 s timeout failed at 0.108 s under a full suite).
    assert 1.0 <= waited < 3 and busy < 0.5 and not listing.answered.is_set()
    listing.let_go.set()
    check.close()

    # A pattern over more entries than the check lists is let through; within them, it is
    # checked.
    for i in range(50):
        (tmp_path / f"{i}.csv").write_text("a\n")
    spec = parse_spec({"name": "x", "data": {"sources": [f"{tmp_path}/*.txt"]}}, spec_dir=None)
    asyncio.run(SourceCheck(settings, max_entries=20)(spec))
    with pytest.raises(SpecError, match="matches no files"):
        asyncio.run(SourceCheck(settings)(spec))
