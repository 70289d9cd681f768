"""The node agent's side of a boxed run's store door (infra.store.door is the rank's side).

The agent holds the store; a run's ranks ask through a unix socket in their box, and every
request is checked here, on the side that cannot lie:

- reads: the run's own keys (`runs/<run>/`), its dataset snapshot, its code snapshot, and the
  checkpoint the control plane authorized it to start from (`model.init_from`);
- writes: the run's checkpoints, peer-tier manifests, attempt ledger and rollback pins, and a
  put only for its own generation (`gen-<g>` in the key); deletes only among its checkpoints
  and peer manifests (retention, a failed upload's leftovers); never the generation fences or
  the shipped logs, which belong to the control plane and the agent;
- the fence: once a later generation of the run has started, this one writes nothing more; a
  manifest put is read against the fences after the put and taken back if a later generation
  resumed from an earlier step;
- a file uploaded by path must be a regular file inside the run's folder on this node, opened
  without following a link and checked by where the opened file really is.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import logging
import os
import re
import shutil
import socketserver
import stat
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from infra.errors import InvalidKey, NotOnTwin, ObjectNotFound, StoreError, StoreUnavailable
from infra.store.protocol import ObjectStore, validate_key
from trainer.manifest import Fences

log = logging.getLogger(__name__)

# A run's own keys its ranks may write: checkpoints, peer-tier manifests, the attempt ledger,
# rollback pins. And those of them a rank may delete.
WRITABLE = ("checkpoints", "peer", "attempts", "pins")
DELETABLE = ("checkpoints", "peer")
_GENERATION = re.compile(r"(?:^|/|-)gen-(\d+)(?:/|\.json$)")
_STEP = re.compile(r"/step-(\d+)/")
MAX_BODY_BYTES = 64 * 2**20  # manifests, ledgers, pins: a file's bytes go by path
# How long a fence read counts for writes that commit nothing (a manifest reads it afresh).
FENCE_TTL_S = 1.0


class Refused(Exception):
    """The request is outside what the run may do; the message says what and why."""


class Fenced(Refused):
    """A later generation of the run has started: this one writes nothing more (HTTP 409)."""


@dataclass(frozen=True)
class DoorPolicy:
    """What one generation of one run may do through its door."""

    run_id: str
    generation: int
    run_dir: Path  # the run's folder on this node: the only place a file is uploaded from
    readable: tuple[str, ...] = ()  # key prefixes beside the run's own
    run_uid: str = ""

    @property
    def own(self) -> str:
        return f"runs/{self.run_id}/"

    def check_read(self, key: str) -> None:
        if not any(key.startswith(prefix) for prefix in (self.own, *self.readable)):
            raise Refused(
                f"{key}: run {self.run_id} may read only its own keys ({self.own}…), its "
                "dataset, its code and the checkpoint it was authorized to start from"
            )

    def check_list(self, prefix: str) -> None:
        if not any(prefix.startswith(p) for p in (self.own, *self.readable)):
            raise Refused(f"listing {prefix!r}: run {self.run_id} may list only its own keys")

    def check_write(self, key: str, delete: bool = False) -> None:
        part = key.removeprefix(self.own).split("/", 1)[0] if key.startswith(self.own) else ""
        if part not in (DELETABLE if delete else WRITABLE):
            allowed = ", ".join(f"{self.own}{p}/" for p in (DELETABLE if delete else WRITABLE))
            raise Refused(
                f"{key}: run {self.run_id} may {'delete' if delete else 'write'} only {allowed}"
            )
        found = _GENERATION.search(key)
        if not delete and (found is None or int(found.group(1)) != self.generation):
            raise Refused(
                f"{key}: generation {self.generation} of run {self.run_id} writes only keys of "
                f"its own generation (gen-{self.generation})"
            )

    def opened_file(self, path: str) -> int:
        """An open descriptor of `path`, a regular file inside the run's folder (by where the
        opened file is, so a link swapped in after a check changes nothing)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as err:
            raise Refused(f"{path}: cannot be read ({err.strerror})") from None
        real = os.readlink(f"/proc/self/fd/{fd}")
        root = os.path.realpath(self.run_dir)
        if not stat.S_ISREG(os.fstat(fd).st_mode) or not real.startswith(root.rstrip("/") + "/"):
            os.close(fd)
            raise Refused(f"{path}: uploads come only from the run's own folder on this node")
        return fd


def door_path(node_dir: Path, run_id: str) -> Path:
    """The folder of a run's door on this node, the same for every generation (a box made for
    the next one, the warm standby's, already holds it), at a short path: a unix socket's path
    has at most 107 bytes."""
    digest = hashlib.sha256(f"{node_dir.resolve()}\0{run_id}".encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"forgeline-door-{digest}"


def door_folder(node_dir: Path, run_id: str) -> Path:
    """door_path, made if it is not there; only the agent's user may enter it."""
    folder = door_path(node_dir, run_id)
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


class StoreDoor:
    """A door for one generation of one run: a unix socket at `socket_path`, served by threads
    until `close`. The agent's store and its credentials never leave this process."""

    def __init__(self, store: ObjectStore, policy: DoorPolicy, socket_path: Path) -> None:
        self.store = store
        self.policy = policy
        self.socket_path = socket_path
        self._fences: tuple[float, Fences] | None = None
        self._fence_lock = threading.Lock()
        self._spool = Path(tempfile.mkdtemp(prefix="forgeline-door-"))
        socket_path.unlink(missing_ok=True)
        self._server = _Server(str(socket_path), _Handler)
        self._server.door = self
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=f"door-{policy.run_id}", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self.socket_path.unlink(missing_ok=True)
        shutil.rmtree(self._spool, ignore_errors=True)

    def __enter__(self) -> StoreDoor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fences(self, fresh: bool = False) -> Fences:
        with self._fence_lock:
            now = time.monotonic()
            if fresh or self._fences is None or now - self._fences[0] > FENCE_TTL_S:
                p = self.policy
                self._fences = (now, Fences.read(self.store, p.run_id, p.run_uid))
            return self._fences[1]

    def check_not_superseded(self) -> None:
        if self.fences().superseded(self.policy.generation):
            raise Fenced(
                f"generation {self.policy.generation} of run {self.policy.run_id} is fenced: a "
                "later generation has started, and this one writes nothing more"
            )

    def put(self, key: str, body: bytes | None, from_file: str | None, if_absent: bool) -> bool:
        self.policy.check_write(key)
        self.check_not_superseded()
        if from_file is not None:
            fd = self.policy.opened_file(from_file)
            try:
                self.store.put_file(key, Path(f"/proc/self/fd/{fd}"))
            finally:
                os.close(fd)
            put = True
        elif if_absent:
            put = self.store.put_if_absent(key, body or b"")
        else:
            self.store.put_bytes(key, body or b"")
            put = True
        if put and key.endswith("/MANIFEST.json"):
            self._take_back_if_stale(key)
        return put

    def _take_back_if_stale(self, key: str) -> None:
        """A manifest put by a generation that a later one fenced meanwhile is removed."""
        step = _STEP.search(key)
        fences = self.fences(fresh=True)
        if step and (why := fences.why_stale(self.policy.generation, int(step.group(1)))):
            self.store.delete(key)
            raise Fenced(f"{key} taken back: {why}")

    def delete(self, key: str) -> None:
        self.policy.check_write(key, delete=True)
        self.check_not_superseded()
        self.store.delete(key)

    @contextlib.contextmanager
    def spooled(self, key: str) -> Iterator[Path]:
        """The object's bytes in a file of the agent's, for streaming to the rank."""
        self.policy.check_read(key)
        fd, name = tempfile.mkstemp(dir=self._spool)
        os.close(fd)
        try:
            self.store.get_file(key, Path(name))
            yield Path(name)
        finally:
            Path(name).unlink(missing_ok=True)


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    door: StoreDoor


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # one connection serves a rank thread's every call
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        log.debug("door %s", format % args)

    def address_string(self) -> str:
        return "rank"

    def do_GET(self) -> None:
        self._answer(self._get)

    def do_HEAD(self) -> None:
        self._answer(self._head)

    def do_PUT(self) -> None:
        self._answer(self._put)

    def do_DELETE(self) -> None:
        self._answer(self._delete)

    def _answer(self, handle: Callable[[StoreDoor, str, str], None]) -> None:
        door = self.server.door
        parsed = urllib.parse.urlsplit(self.path)
        route, _, rest = parsed.path.lstrip("/").partition("/")
        try:
            key = validate_key(rest) if rest else ""
            handle(door, route, key)
        except Refused as err:
            log.warning("store door of run %s refused: %s", door.policy.run_id, err)
            self._send(409 if isinstance(err, Fenced) else 403, str(err).encode())
        except (InvalidKey, ValueError) as err:
            self._send(400, str(err).encode())
        except ObjectNotFound as err:
            self._send(404, str(err).encode())
        except NotOnTwin as err:
            self._send(503, str(err).encode(), {"X-Not-On-Twin": "1"})
        except StoreUnavailable as err:
            self._send(503, str(err).encode())
        except StoreError as err:
            self._send(500, str(err).encode())

    def _get(self, door: StoreDoor, route: str, key: str) -> None:
        if route == "o":
            with door.spooled(key) as spooled, open(spooled, "rb") as data:
                self._send_headers(200, spooled.stat().st_size)
                shutil.copyfileobj(data, self.wfile, 1 << 20)
        elif route in ("digest", "claimed-digest"):
            door.policy.check_read(key)
            size, sha256 = (door.store.digest if route == "digest" else door.store.claimed_digest)(
                key
            )
            self._send(200, json.dumps([size, sha256]).encode())
        elif route == "list":
            query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
            prefix = query.get("prefix", [""])[0]
            door.policy.check_list(prefix)
            self._send(200, json.dumps(door.store.list(prefix)).encode())
        elif route == "reachable":
            self._send(200, json.dumps(door.store.reachable()).encode())
        else:
            self._send(404, f"no route {route!r}".encode())

    def _delete(self, door: StoreDoor, route: str, key: str) -> None:
        door.delete(key)
        self._send(204)

    def _head(self, door: StoreDoor, route: str, key: str) -> None:
        door.policy.check_read(key)
        self._send_headers(200 if door.store.exists(key) else 404, 0)

    def _put(self, door: StoreDoor, route: str, key: str) -> None:
        size = int(self.headers.get("Content-Length") or 0)
        if size > MAX_BODY_BYTES:
            self.close_connection = True  # the body stays unread: this connection is done
            raise Refused(f"{key}: a body over {MAX_BODY_BYTES} bytes (a file goes by path)")
        body = self.rfile.read(size) if size else b""
        put = door.put(
            key,
            body,
            self.headers.get("X-From-File"),
            if_absent=self.headers.get("If-None-Match") == "*",
        )
        self._send(201 if put else 412)

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self._send_headers(status, len(body), headers)
        if body:
            self.wfile.write(body)

    def _send_headers(
        self, status: int, length: int, headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(length))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
