"""Training metrics to MLflow off the critical path: spool to local disk, ship in the background.

The writer (`MetricSpool`) only appends JSON lines to a local file, so a training step never waits
on the network. A daemon thread (`MetricShipper`) sends what is new to MLflow every few seconds
and records how far each file was acknowledged in a sidecar offset file, written only after a
send succeeded. While MLflow is unreachable the lines simply wait on disk; a shipper restarted on
the same folder resends only what was never acknowledged (at-least-once). Resends are harmless on
a SQL-backed MLflow: its metrics table is keyed on (key, value, timestamp, step), and a repeated
identical point is dropped on insert, so every line keeps the timestamp it was spooled with.

Spool layout, one file per stream: `<dir>/<mlflow run id>__<stream>.jsonl`, beside it
`<file>.offset` (bytes acknowledged) and, once its writer closed it, `<file>.closed`.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SUFFIX = ".jsonl"
OFFSET = ".offset"
CLOSED = ".closed"
MAX_BATCH = 1000  # MLflow's log-batch limit on metrics per request
_SEPARATOR = "__"
# MLflow run ids are uuid4 hex; no "__" in the run id keeps the file name unambiguous.
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*(?:_[A-Za-z0-9-]+)*")
_STREAM = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]*")
_KEY = re.compile(r"[/\w.\- :]{1,250}")  # what MLflow accepts as a metric name
# Trouble that passes (or a setting to fix): wait and send the same batch again, whatever
# the body says. A batch MLflow judges invalid is dropped instead: held, it would stop the
# whole stream behind it forever.
_RETRY_STATUS = {401, 403, 408, 409, 425, 429}
# MLflow error codes that judge the batch itself (a 400 or 404 with one of these).
_REJECTED_CODES = {
    "INVALID_PARAMETER_VALUE",
    "RESOURCE_DOES_NOT_EXIST",
    "INVALID_STATE",
    "BAD_REQUEST",
}


# (mlflow run id, metrics in wire form, deadline on the monotonic clock or None)
_Sender = Callable[[str, list[dict[str, Any]], float | None], None]


class ShipError(Exception):
    """MLflow could not be reached or was not ready: keep the data and try again later."""


class BatchRejected(Exception):
    """MLflow refused this batch for what it contains: retrying cannot help."""


def spool_path(spool_dir: Path, run_id: str, stream: str) -> Path:
    if not _RUN_ID.fullmatch(run_id):
        raise ValueError(f"MLflow run id {run_id!r} is not a plain id (letters, digits, -, _)")
    if not _STREAM.fullmatch(stream):
        raise ValueError(f"metric stream name {stream!r}: use letters, digits, '.' and '-'")
    return spool_dir / f"{run_id}{_SEPARATOR}{stream}{SUFFIX}"


class MetricSpool:
    """Appends metrics of one MLflow run to a local file; never touches the network.

    One writer per stream: give each attempt that may run again its own stream name, so a
    closed, fully shipped file that the shipper deletes is never written to again.
    """

    def __init__(self, spool_dir: Path, run_id: str, stream: str) -> None:
        self.path = spool_path(spool_dir, run_id, stream)
        self.run_id = run_id
        spool_dir.mkdir(parents=True, exist_ok=True)
        _sidecar(self.path, CLOSED).unlink(missing_ok=True)
        self._handle = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        if self._handle.tell() and not _ends_with_newline(self.path):
            # A writer died mid-line: end its torn line so ours are not glued onto it.
            self._handle.write("\n")
        self._lock = threading.Lock()

    def log(self, key: str, value: float, step: int, timestamp_ms: int | None = None) -> None:
        self.log_dict({key: value}, step, timestamp_ms)

    def log_dict(
        self, values: Mapping[str, float | None], step: int, timestamp_ms: int | None = None
    ) -> None:
        """Append one line per numeric value (None and non-numbers are left out), in one write."""
        timestamp = int(time.time() * 1000) if timestamp_ms is None else int(timestamp_ms)
        for key in values:
            if not _KEY.fullmatch(key):  # caught here, where the caller can still fix it
                raise ValueError(f"metric name {key!r}: use letters, digits and _ - . : / space")
        lines = [
            json.dumps({"key": k, "value": float(v), "timestamp": timestamp, "step": int(step)})
            for k, v in values.items()
            if isinstance(v, int | float)
        ]
        if not lines:
            return
        with self._lock:
            if self._handle.closed:
                raise ValueError(f"metric spool {self.path.name} is closed")
            # Flushed to the OS, not fsynced: the shipper sees it at once, and a step pays
            # one write call, not a disk sync.
            self._handle.write("\n".join(lines) + "\n")
            self._handle.flush()

    def close(self) -> None:
        with self._lock:
            if self._handle.closed:
                return
            self._handle.close()
            _sidecar(self.path, CLOSED).touch()

    def __enter__(self) -> MetricSpool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def seal_abandoned(spool_dir: Path) -> int:
    """Mark every spool file closed; call it only while no writer of this folder can be alive
    (an agent starting), so files of a crashed predecessor are deleted once shipped."""
    sealed = 0
    for path in spool_dir.glob(f"*{SUFFIX}"):
        marker = _sidecar(path, CLOSED)
        if not marker.exists():
            marker.touch()
            sealed += 1
    return sealed


@dataclass
class _Batch:
    run_id: str
    metrics: list[dict[str, Any]]
    end: int  # the file offset after the last line of this batch


class MetricShipper:
    """Daemon thread: ships every spool file of a folder to MLflow, forever, at least once."""

    def __init__(
        self,
        spool_dir: Path,
        tracking_uri: str,
        interval_s: float = 2.0,
        max_backoff_s: float = 15.0,
        request_timeout_s: float = 5.0,
    ) -> None:
        self.spool_dir = spool_dir
        self.interval_s = interval_s
        # 15 s, not more: after an outage the backlog should be on screen within ~30 s.
        self.max_backoff_s = max_backoff_s
        self._sender = _make_sender(tracking_uri, request_timeout_s)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._pass_lock = threading.Lock()  # one shipping pass at a time (thread or flush)
        self._thread: threading.Thread | None = None
        self.failures = 0  # consecutive failed passes (connection trouble), for the back-off
        self.rejected = 0  # metrics MLflow refused, skipped so the stream goes on

    def start(self) -> MetricShipper:
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="metric-shipper", daemon=True)
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def deliver(self, timeout_s: float) -> bool:
        """Ship what is spooled now, waiting at most `timeout_s`, unless MLflow is known to be
        down (the last pass failed): then nothing waits, and the backlog ships when it is back.
        True if everything spooled is acknowledged."""
        if self.failures:
            return False
        return self.flush(timeout_s)

    def stop(self, flush_timeout_s: float = 3.0) -> bool:
        """Stop the thread, then try once more to ship within the time given; True if nothing
        is left unshipped (whatever is left waits on disk for the next shipper)."""
        deadline = time.monotonic() + flush_timeout_s
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))
            if self._thread.is_alive():  # stuck in a request: it is a daemon, leave it
                return False
            self._thread = None
        return self.flush(max(0.0, deadline - time.monotonic()))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Ship now, ignoring the back-off, until nothing is pending or time is up; True if all
        that was spooled is acknowledged."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.ship_once(deadline):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def ship_once(self, deadline: float | None = None) -> bool:
        """One pass over the spool folder; True if every file is shipped to its end."""
        with self._pass_lock:
            try:
                done = self._ship_all(deadline)
            except ShipError as err:
                self.failures += 1
                # Once per outage, not once per retry: the agent's log stays readable.
                level = logging.WARNING if self.failures == 1 else logging.DEBUG
                log.log(level, "MLflow unreachable, metrics stay spooled: %s", err)
                return False
            if done:
                self._answered()
            return done

    def _answered(self) -> None:
        """MLflow answered: the outage, if any, is over and the back-off starts afresh."""
        if self.failures:
            log.info("MLflow reachable again after %d failed attempts", self.failures)
        self.failures = 0

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.ship_once()
            except Exception:  # never let the thread die: it ships forever
                log.exception("metric shipping pass failed")
            wait = self.interval_s
            if self.failures:
                wait = min(self.max_backoff_s, self.interval_s * 2 ** (self.failures - 1))
            self._wake.wait(wait)
            self._wake.clear()

    def _ship_all(self, deadline: float | None) -> bool:
        done = True
        for path in sorted(self.spool_dir.glob(f"*{SUFFIX}")):
            if deadline is not None and time.monotonic() >= deadline:
                return False
            done = self._ship_file(path, deadline) and done
        for sidecar in self.spool_dir.glob(f"*{SUFFIX}.*"):  # leftovers of deleted files
            data = sidecar.name[: sidecar.name.index(SUFFIX) + len(SUFFIX)]
            if not sidecar.with_name(data).exists():
                sidecar.unlink(missing_ok=True)
        return done

    def _ship_file(self, path: Path, deadline: float | None) -> bool:
        run_id = path.name[: -len(SUFFIX)].split(_SEPARATOR, 1)[0]
        closed = _sidecar(path, CLOSED).exists()  # read before the data: nothing follows it
        offset = _read_offset(path)
        for batch in _read_batches(path, offset, run_id):
            if batch.metrics:
                self._send(batch.run_id, batch.metrics, deadline, path.name)
            _write_offset(path, batch.end)
            offset = batch.end
            if deadline is not None and time.monotonic() >= deadline:
                break
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return True
        if offset < size and not (closed and _only_torn_tail(path, offset)):
            return False
        if closed:
            for leftover in (path, _sidecar(path, OFFSET), _sidecar(path, CLOSED)):
                leftover.unlink(missing_ok=True)
        return True

    def _send(
        self, run_id: str, metrics: list[dict[str, Any]], deadline: float | None, name: str
    ) -> None:
        """Send a batch; if MLflow refuses it, halve it until only the culprits are left out,
        so one bad point (a NaN in a store that refuses it, a bad key) costs only itself."""
        try:
            self._sender(run_id, metrics, deadline)
            self._answered()
        except BatchRejected as err:
            self._answered()
            if len(metrics) == 1:
                self.rejected += 1
                log.error("MLflow refused a metric of %s, skipped: %s: %s", name, metrics[0], err)
                return
            half = len(metrics) // 2
            self._send(run_id, metrics[:half], deadline, name)
            self._send(run_id, metrics[half:], deadline, name)


def _sidecar(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as handle:
        handle.seek(-1, os.SEEK_END)
        return handle.read(1) == b"\n"


def _only_torn_tail(path: Path, offset: int) -> bool:
    """What is left after `offset` holds no complete line (a writer died mid-line)."""
    with open(path, "rb") as handle:
        handle.seek(offset)
        return b"\n" not in handle.read()


def _read_offset(path: Path) -> int:
    try:
        offset = int(_sidecar(path, OFFSET).read_text())
    except (OSError, ValueError):
        return 0
    try:
        size = path.stat().st_size
    except OSError:
        return 0
    # An offset past the end means the file is not the one it was written for: start over
    # (MLflow drops the points it already has).
    return offset if 0 <= offset <= size else 0


def _write_offset(path: Path, offset: int) -> None:
    # Write-then-rename: a crash leaves the old offset or the new one, never a torn number.
    target = _sidecar(path, OFFSET)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(str(offset))
    os.replace(tmp, target)


def _read_batches(path: Path, offset: int, run_id: str) -> Iterator[_Batch]:
    """Batches of at most MAX_BATCH metrics from `offset`, complete lines only."""
    try:
        handle = open(path, "rb")  # noqa: SIM115
    except FileNotFoundError:
        return
    with handle:
        handle.seek(offset)
        metrics: list[dict[str, Any]] = []
        position = offset
        for raw in handle:
            if not raw.endswith(b"\n"):
                break  # a line still being written: it ships next time
            position += len(raw)
            metric = _parse(raw, path)
            if metric is not None:
                metrics.append(metric)
            if len(metrics) >= MAX_BATCH:
                yield _Batch(run_id, metrics, position)
                metrics = []
        if metrics or position != offset:
            yield _Batch(run_id, metrics, position)


def _parse(raw: bytes, path: Path) -> dict[str, Any] | None:
    try:
        line = json.loads(raw)
        return {
            "key": str(line["key"]),
            "value": _wire_value(float(line["value"])),
            "timestamp": int(line["timestamp"]),
            "step": int(line.get("step", 0)),
        }
    except (ValueError, KeyError, TypeError):
        if raw.strip():  # blank: the end of a line torn by a crashed writer
            log.error("skipping a malformed metric line in %s: %r", path.name, raw[:200])
        return None


def _wire_value(value: float) -> float | str:
    # A bare NaN token is not JSON: MLflow 3.17 answers 200 and stores a zeroed point. The
    # proto3 JSON spellings are stored as NaN / ±max float, which the UI shows.
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def _make_sender(tracking_uri: str, timeout_s: float) -> _Sender:
    if tracking_uri.startswith(("http://", "https://")):
        return _RestSender(tracking_uri, timeout_s)
    return _ClientSender(tracking_uri)


class _RestSender:
    """POSTs log-batch directly: no `import mlflow` (seconds) in the agent, and a short timeout
    instead of the MLflow client's minutes of built-in retries: the shipper retries itself."""

    def __init__(self, tracking_uri: str, timeout_s: float) -> None:
        self.url = tracking_uri.rstrip("/") + "/api/2.0/mlflow/runs/log-batch"
        self.timeout_s = timeout_s
        self.headers = {"Content-Type": "application/json", **_auth_headers()}

    def __call__(self, run_id: str, metrics: list[dict], deadline: float | None) -> None:
        timeout = self.timeout_s
        if deadline is not None:
            timeout = max(0.1, min(timeout, deadline - time.monotonic()))
        body = json.dumps({"run_id": run_id, "metrics": metrics}, allow_nan=False).encode()
        request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                response.read()
        except urllib.error.HTTPError as err:
            detail = err.read()[:500].decode(errors="replace")
            # Only MLflow's own verdict on the content drops data; a 404 page of a proxy or a
            # wrong URI keeps it until the setting is fixed.
            if _error_code(detail) in _REJECTED_CODES and err.code not in _RETRY_STATUS:
                raise BatchRejected(f"HTTP {err.code}: {detail}") from err
            raise ShipError(f"HTTP {err.code} from {self.url}: {detail}") from err
        except (OSError, ValueError) as err:  # URLError, refused, reset, timeout
            raise ShipError(f"{self.url}: {err}") from err


def _error_code(body: str) -> str | None:
    try:
        found = json.loads(body).get("error_code")
    except (ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None


def _auth_headers() -> dict[str, str]:
    """The same credentials the MLflow client reads from the environment."""
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    if token:
        return {"Authorization": f"Bearer {token}"}
    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    password = os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if user and password:
        basic = base64.b64encode(f"{user}:{password}".encode()).decode()
        return {"Authorization": f"Basic {basic}"}
    return {}


class _ClientSender:
    """Local stores (sqlite:///, file paths) go through MlflowClient, imported on first use."""

    def __init__(self, tracking_uri: str) -> None:
        self.tracking_uri = tracking_uri
        self._client: Any = None

    def __call__(self, run_id: str, metrics: list[dict], deadline: float | None) -> None:
        from mlflow.entities import Metric
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        if self._client is None:
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        batch = [Metric(m["key"], float(m["value"]), m["timestamp"], m["step"]) for m in metrics]
        try:
            self._client.log_batch(run_id, metrics=batch, synchronous=True)
        except MlflowException as err:
            if err.error_code in _REJECTED_CODES:
                raise BatchRejected(str(err)) from err
            raise ShipError(str(err)) from err
        except Exception as err:  # a locked or missing store: the data waits
            raise ShipError(str(err)) from err
