"""The HTTP API's refusals, served by uvicorn over HTTP with no stack behind it: whatever goes
wrong, the answer is the one error shape, and bad input is refused before Temporal (which is
not even there)."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from forgeline import ApiError, Client
from infra import code_snapshot
from infra.processes import free_port
from infra.settings import Settings
from infra.tokens import TokenStore
from tests.api_server import serving_api
from workflows.contracts.api_models import SubmitAnswer, SubmitRequest


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    # Temporal's address is a free port nobody listens on: the API must not need it to refuse.
    # The corpora are written in tmp_path, which is in no data root unless it is said to be.
    settings = Settings(
        home=tmp_path, temporal_address=f"127.0.0.1:{free_port()}", data_roots=str(tmp_path)
    )
    with serving_api(settings) as url:
        yield url, tmp_path


def refused(call, status: int, code: str) -> ApiError:
    with pytest.raises(ApiError) as raised:
        call()
    assert (raised.value.status, raised.value.code) == (status, code), raised.value
    return raised.value


def test_every_refusal_has_the_one_shape(api: tuple[str, Path]) -> None:
    url, home = api
    token, _ = TokenStore(home).create("alice", ["submit:research"], created_by="test")
    alice = Client(url, token)
    assert alice.whoami().roles == ["submit:research"]
    refused(Client(url, "flt_" + "0" * 12 + "_" + "a" * 43).whoami, 401, "unauthenticated")

    relative = {"name": "x", "data": {"sources": ["corpus.txt"]}, "resources": {"team": "research"}}
    error = refused(lambda: alice.submit(relative), 422, "invalid_spec")
    assert error.field == "data.sources" and "is relative" in error.message
    other_team = {"name": "x", "data": {"sources": ["/dev/null"]}}  # team "default"
    assert refused(lambda: alice.submit(other_team), 403, "forbidden").field == "resources.team"
    refused(lambda: alice.status("Not A Name"), 422, "invalid_name")

    # Reads need Temporal, which is not there: 503, with what to do.
    assert "Temporal" in refused(alice.runs, 503, "unavailable").message
    # A hand-edited rules file that is not UTF-8 is a bug's path: 500, the same shape.
    (home / "approvals.toml").write_bytes(b"[defaults]\napprovers = ['\xff']\n")
    error = refused(lambda: alice._call("GET", "/v1/approvals"), 500, "internal")
    assert "UnicodeDecodeError" in error.message
    refused(lambda: alice._call("GET", "/v1/nothing"), 404, "not_found")


def _spec(corpus: Path, code: Path | None) -> dict:
    train = {"code": str(code), "entrypoint": "train.py"} if code else {}
    return {"name": "x", "data": {"sources": [str(corpus)]}, "resources": {"team": "research"},
            "train": train}  # fmt: skip


def test_code_is_uploaded_as_a_snapshot_and_checked_before_temporal(
    api: tuple[str, Path], tmp_path: Path
) -> None:
    url, home = api
    tokens = TokenStore(home)
    alice = Client(url, tokens.create("alice", ["submit:research"], created_by="test")[0])
    reader = Client(url, tokens.create("rhea", ["read"], created_by="test")[0])
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text("import forgeline\n")
    (code / ".gitignore").write_text("*.ckpt\n")
    (code / "weights.ckpt").write_bytes(b"left out")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be.\n")

    uploaded = alice.upload_code(code)
    assert uploaded.snapshot_id == code_snapshot.pack(code)[1] and uploaded.files == 2
    assert Settings(home=home).open_store().exists(uploaded.manifest_key)
    refused(lambda: reader.upload_code(code), 403, "forbidden")
    for member in ("../escape.py", "/etc/cron.d/x"):
        error = refused(lambda m=member: alice._call("POST", "/v1/code", raw=_tar(m)), 422,
                        "invalid_code")  # fmt: skip
        assert error.field == "code" and "leaves the code folder" in error.message
    assert not (tmp_path / "escape.py").exists()

    # The submit's code must be the snapshot of its train.code, in the store: else 422, and
    # nothing reaches Temporal (whose absence is the 503 once everything is in order).
    send = lambda spec, ref: alice._call(  # noqa: E731
        "POST", "/v1/runs", SubmitRequest(spec=spec, code=ref), SubmitAnswer
    )
    assert "cannot read a folder" in refused(lambda: send(_spec(corpus, code), None), 422,
                                             "invalid_code").message  # fmt: skip
    forged = uploaded.model_copy(update={"manifest_sha256": "0" * 64})
    refused(lambda: send(_spec(corpus, code), forged), 422, "invalid_code")
    refused(lambda: send(_spec(corpus, None), uploaded), 422, "invalid_code")
    refused(lambda: send(_spec(corpus, code), uploaded), 503, "unavailable")
    refused(lambda: alice.submit(_spec(corpus, code)), 503, "unavailable")  # uploads, then submits


def _tar(name: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = 2
        tar.addfile(info, io.BytesIO(b"x\n"))
    return buffer.getvalue()
