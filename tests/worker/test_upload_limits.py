"""POST /v1/code costs the API what the upload's size says, whatever its .gitignore holds, and
only so many uploads are taken at a time (worker/api_code.py, worker/request_limits.Slots)."""

from __future__ import annotations

import asyncio
import io
import tarfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

from infra import code_snapshot
from infra.digest import sha256_bytes
from infra.settings import Settings
from infra.tokens import TokenStore
from tests.asgi_call import call
from worker.api import make_app
from worker.api_code import MAX_UPLOADS_AT_ONCE


def _app(home: Path) -> tuple[object, dict[str, str]]:
    token, _ = TokenStore(home).create("alice", ["submit:research"], created_by="test")
    headers = {"authorization": f"Bearer {token}", "content-type": "application/x-tar"}
    return make_app(Settings(home=home)), headers


def _tar(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_an_upload_s_gitignore_costs_the_api_nothing(tmp_path: Path) -> None:
    app, headers = _app(tmp_path)
    # Patterns whose regexes backtrack on long names: 3,000 of them against 50 such names took
    # seconds of CPU when the API applied them again (a 2 MiB file of them, minutes).
    ignore = "\n".join(["*.ckpt", *(f"a*a*a*{i}" for i in range(3000))]).encode()
    files = {".gitignore": ignore, "train.py": b"print()\n", "w.ckpt": b"kept\n"}
    files |= {f"{'a' * 40}{i}.py": b"x\n" for i in range(50)}
    started = time.monotonic()
    answer = asyncio.run(call(app, "POST", "/v1/code", headers, [_tar(files)]))
    elapsed = time.monotonic() - started
    assert answer.status == 200, answer.body
    assert elapsed < 1.0, f"{elapsed:.1f} s"
    # Published as uploaded: the client applied .gitignore when it packed the folder.
    listed = [code_snapshot.CodeFile(name, len(data), sha256_bytes(data))
              for name, data in files.items()]  # fmt: skip
    assert answer.json()["snapshot_id"] == code_snapshot.snapshot_id(listed)
    assert answer.json()["files"] == len(files)


def test_uploads_past_the_limit_are_refused_with_retry_after(tmp_path: Path) -> None:
    app, headers = _app(tmp_path)

    async def main() -> tuple[list[int], object, int]:
        arrived = asyncio.Event()
        reading = 0  # uploads whose handler holds a slot and reads the body

        async def slow(n: int) -> AsyncIterator[bytes]:
            nonlocal reading
            reading += 1
            await arrived.wait()  # the client sends nothing until the test says so
            yield _tar({"train.py": f"print({n})\n".encode()})

        held = [asyncio.create_task(call(app, "POST", "/v1/code", headers, slow(n)))
                for n in range(MAX_UPLOADS_AT_ONCE)]  # fmt: skip
        # Each is in, holding its slot, waiting on its body. Waited for, not slept on: on a
        # busy machine 0.1 s once let the fifth take a slot before the fourth had its own.
        async with asyncio.timeout(30):
            while reading < MAX_UPLOADS_AT_ONCE:
                await asyncio.sleep(0.01)
        refused = await call(app, "POST", "/v1/code", headers, [_tar({"train.py": b"x\n"})])
        arrived.set()
        statuses = [answer.status for answer in await asyncio.gather(*held)]
        again = await call(app, "POST", "/v1/code", headers, [_tar({"train.py": b"y\n"})])
        return statuses, refused, again.status

    statuses, refused, again = asyncio.run(main())
    assert statuses == [200] * MAX_UPLOADS_AT_ONCE and again == 200
    assert (refused.status, refused.read, refused.headers["retry-after"]) == (429, 0, "5")
    error = refused.json()["error"]
    assert error["code"] == "busy" and f"{MAX_UPLOADS_AT_ONCE} code uploads" in error["message"]
