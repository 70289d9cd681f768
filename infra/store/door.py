"""The store as a boxed rank reaches it: through its node agent's door, a unix socket.

A rank holds no credential of the store. Its job names `door:///run/forgeline/door.sock`; every
call below is one HTTP request over that socket to the agent, which holds the store and decides
what this run may read and write (trainer.store_door). A file the rank wrote in its run's
folder is uploaded by path (`X-From-File`): the agent reads it from the same disk, so the bytes
of a checkpoint cross the socket not at all.

    GET    /o/<key>                 the object's bytes          404: not found
    PUT    /o/<key>                 put the body, or the file X-From-File names
    PUT    /o/<key>  If-None-Match: *   create if absent        412: there already
    HEAD   /o/<key>                 exists                      404: not found
    DELETE /o/<key>
    GET    /digest/<key>, /claimed-digest/<key>   [size, sha256]
    GET    /list?prefix=P           the keys under P
    GET    /reachable               whether the agent's store answers

A refusal is 403 with the reason as its body (DoorRefused here, naming the key and the rule);
409 when the run's generation is fenced (DoorFenced); 503 when the agent's store is away, with
`X-Not-On-Twin` when the twin standing in lacks the object (NotOnTwin, as the store says it).
"""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import threading
import urllib.parse
from pathlib import Path
from typing import Any

from infra.errors import NotOnTwin, ObjectNotFound, StoreError, StoreUnavailable

SCHEME = "door://"
CHUNK = 1 << 20


class DoorRefused(StoreError):
    """The agent refused the call: the key is outside what this run may read or write."""


class DoorFenced(DoorRefused):
    """The agent refused a write because a later generation of the run has started (or took a
    manifest back for it): this generation is fenced, as a checkpointer that read the fences
    itself would have found."""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, socket_path: str, timeout: float) -> None:
        super().__init__("door", timeout=timeout)
        self._socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._socket_path)
        self.sock = sock


class DoorStore:
    """An ObjectStore whose every call goes through the node agent's door."""

    def __init__(self, socket_path: str, timeout_s: float = 600.0) -> None:
        self.socket_path = socket_path
        self.url = SCHEME + socket_path
        self._timeout_s = timeout_s
        # One connection a thread: checkpoint uploads run in threads of their own.
        self._local = threading.local()

    @classmethod
    def from_url(cls, url: str) -> DoorStore:
        return cls(url.removeprefix(SCHEME))

    def put_bytes(self, key: str, data: bytes) -> None:
        self._call("PUT", f"/o/{key}", body=data)

    def put_file(self, key: str, path: Path) -> None:
        self._call("PUT", f"/o/{key}", headers={"X-From-File": str(Path(path).absolute())})

    def put_if_absent(self, key: str, data: bytes) -> bool:
        status, _ = self._call("PUT", f"/o/{key}", body=data, headers={"If-None-Match": "*"},
                               accept=(412,))  # fmt: skip
        return status != 412

    def get_bytes(self, key: str) -> bytes:
        return self._call("GET", f"/o/{key}")[1]

    def get_file(self, key: str, dest: Path) -> None:
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.with_name(dest.name + ".partial")
        with self._response("GET", f"/o/{key}") as response, open(partial, "wb") as out:
            shutil.copyfileobj(response, out, CHUNK)
        partial.replace(dest)

    def exists(self, key: str) -> bool:
        return self._call("HEAD", f"/o/{key}", accept=(404,))[0] == 200

    def digest(self, key: str) -> tuple[int, str]:
        size, sha256 = json.loads(self._call("GET", f"/digest/{key}")[1])
        return int(size), str(sha256)

    def claimed_digest(self, key: str) -> tuple[int, str]:
        size, sha256 = json.loads(self._call("GET", f"/claimed-digest/{key}")[1])
        return int(size), str(sha256)

    def list(self, prefix: str) -> list[str]:
        query = urllib.parse.urlencode({"prefix": prefix})
        return [str(key) for key in json.loads(self._call("GET", f"/list?{query}")[1])]

    def delete(self, key: str) -> None:
        self._call("DELETE", f"/o/{key}")

    def reachable(self) -> bool:
        try:
            return bool(json.loads(self._call("GET", "/reachable")[1]))
        except (StoreError, OSError):
            return False

    def _connection(self) -> _UnixConnection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = _UnixConnection(self.socket_path, self._timeout_s)
            self._local.connection = connection
        return connection

    def _call(self, method: str, path: str, **request: Any) -> tuple[int, bytes]:
        """_response's status and whole body."""
        with self._response(method, path, **request) as response:
            return response.status, response.read()

    def _response(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        accept: tuple[int, ...] = (),
    ) -> http.client.HTTPResponse:
        connection = self._connection()
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
        except (OSError, http.client.HTTPException) as err:
            connection.close()
            door = self.socket_path
            raise StoreUnavailable(f"the node agent's store door {door}: {err}") from err
        if response.status < 300 or response.status in accept:
            return response
        reason = response.read().decode(errors="replace")
        key = path.split("?", 1)[0]
        if response.status == 404:
            raise ObjectNotFound(f"{key}: {reason}")
        if response.status == 409:
            raise DoorFenced(reason)
        if response.status == 403:
            raise DoorRefused(reason)
        if response.status == 503 and response.getheader("X-Not-On-Twin"):
            raise NotOnTwin(reason)  # resume passes such a checkpoint over for an older one
        if response.status == 503:
            raise StoreUnavailable(reason)
        raise StoreError(f"{method} {key}: {response.status} {reason}")
