"""`forgeline serve MODEL[@ALIAS|/VERSION]` and `forgeline generate MODEL "prompt"`: a registered
model answering prompts, behind MLflow's scoring server or once.

The model's own code never runs in this process: it runs in a process of its own, boxed where
this host can box it, with none of the caller's secrets (worker.model_box). The server is
MLflow's own scoring server (uvicorn, what `mlflow models serve` runs), so what answers here
answers the same way in a container built with `mlflow models build-docker`: POST {"inputs":
[prompts], "params": {"max_new_tokens": N, "seed": S}} to /invocations, get {"predictions":
[continuations]}.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from infra.extras import require_extra
from infra.processes import ManagedProcess, free_port, http_ok, port_is_open
from registry.names import DECISION_TAG, PRODUCTION, SERVABLE_TAG
from worker import model_box
from worker.cli_common import check_name
from worker.verified_model import UnverifiedModel, VerifiedFolder, fetch_verified

# MLflow's own rule for aliases (letters, digits, `_`, `-`); checked here so a typo is refused
# before it becomes part of a models:/ URI.
ALIAS_PATTERN = r"^[A-Za-z0-9_-]{1,255}$"
START_TIMEOUT_S = 180.0  # importing torch and MLflow on a busy 2-core machine takes a while


class ServeError(Exception):
    """The model cannot be found, served or reached; the message says which and what to do."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail  # the server's last lines, when it is the server that failed


@dataclass(frozen=True)
class ModelRef:
    """NAME@ALIAS or NAME/VERSION: exactly one of `alias` and `version` is set."""

    name: str
    alias: str | None = None
    version: str | None = None

    @property
    def uri(self) -> str:
        return f"models:/{self}"

    def __str__(self) -> str:
        return f"{self.name}@{self.alias}" if self.alias else f"{self.name}/{self.version}"


def parse_ref(text: str, default_alias: str = PRODUCTION) -> ModelRef:
    """`NAME` (the default alias), `NAME@ALIAS` or `NAME/VERSION`."""
    if "@" in text:
        name, alias = text.split("@", 1)
        if not re.fullmatch(ALIAS_PATTERN, alias):  # match's '$' would allow a final newline
            raise ServeError(
                f"alias {alias!r} is not valid: use letters, digits, '_' and '-' "
                f"(e.g. {name}@{PRODUCTION})"
            )
        ref = ModelRef(name, alias=alias)
    elif "/" in text:
        name, version = text.split("/", 1)
        if not version.isdigit():
            raise ServeError(f"version {version!r} is not a number: use NAME/3 or NAME@ALIAS")
        ref = ModelRef(name, version=str(int(version)))
    else:
        ref = ModelRef(text, alias=default_alias)
    check_name(ref.name, "model name")
    return ref


def check_registered(tracking_uri: str, ref: ModelRef) -> str:
    """The version `ref` points at now; fails with the fix when there is none."""
    return _registered(tracking_uri, ref).number


@dataclass(frozen=True)
class Registered:
    number: str
    approved: bool  # Forgeline's gate recorded an approval on it

    def describe(self, ref: ModelRef) -> str:
        return f"{ref.name} version {self.number}"


def _registered(tracking_uri: str, ref: ModelRef) -> Registered:
    # Late: importing MLflow costs every `forgeline` command 1.4 s, and only this one needs it.
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from registry.tracking import lookup_version

    _check_reachable(tracking_uri)
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    found = lookup_version(client, ref.name, alias=ref.alias, version=ref.version)
    if found is not None:
        if found.tags.get(SERVABLE_TAG) == "false":
            raise ServeError(
                f"{ref.name} version {found.version} holds weights and lineage only: the "
                f"script that trained it ({found.tags.get('forgeline.entrypoint', 'yours')}) "
                "does not say how to serve it, so there is nothing to load as a model here; "
                f"its weights are model/model.safetensors in MLflow run {found.run_id}"
            )
        if ref.alias == PRODUCTION and found.tags.get(DECISION_TAG) != "approved":
            # Anyone who can write to MLflow can move an alias; only Forgeline's approval gate
            # records a decision on the version. A production that skipped the gate is not
            # served as production.
            raise ServeError(
                f"{ref.name}@{PRODUCTION} points at version {found.version}, which Forgeline "
                f"never approved (its {DECISION_TAG} tag is "
                f"{found.tags.get(DECISION_TAG, 'missing')!r}): the alias was moved outside "
                f"Forgeline; approve its run with `forgeline approve RUN`, or serve "
                f"{ref.name}/{found.version} by number if you mean to"
            )
        return Registered(str(found.version), found.tags.get(DECISION_TAG) == "approved")
    try:
        client.get_registered_model(ref.name)
    except MlflowException:
        raise ServeError(
            f"no model named {ref.name} in the registry at {tracking_uri}: "
            "`forgeline runs` shows each run's model"
        ) from None
    if ref.alias == PRODUCTION:
        fix = (
            "approve one with `forgeline approve RUN` (as an approver) "
            f"(or serve {ref.name}@candidate)"
        )
    elif ref.alias:
        fix = f"set the alias in the MLflow UI, or serve {ref.name}/VERSION"
    else:
        fix = f"the MLflow UI at {tracking_uri} lists its versions"
    what = f"alias {ref.alias}" if ref.alias else f"number {ref.version}"
    raise ServeError(f"{ref.name} has no version with {what}: {fix}")


def _check_reachable(tracking_uri: str) -> None:
    # MlflowClient retries an unreachable server with back-off for minutes; ask once, quickly.
    if tracking_uri.startswith(("http://", "https://")) and not http_ok(f"{tracking_uri}/health"):
        raise ServeError(
            f"cannot reach MLflow at {tracking_uri}: start the local stack with `forgeline up`"
        )


@dataclass
class ModelServer:
    """The model's scoring server and the relay in front of it (worker.model_box) in their own
    process group, with their log file."""

    ref: ModelRef
    version: str
    url: str
    process: ManagedProcess
    scratch: Path | None = None  # holds the verified copy it serves, removed when it stops

    def running(self) -> bool:
        return self.process.running()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the group and wait for all of it: the port is free once this returns."""
        group = self.process.pid()  # the leader's pid is the group's id (its own session)
        self.process.stop(timeout=timeout_s)
        # The leader (the relay) exits at once; bwrap, in the same group, takes the box with it
        # (what runs inside dies with it), and unboxed uvicorn finishes its requests and shuts
        # down after it. Only an empty group means the server is gone.
        deadline, killed = time.monotonic() + timeout_s, False
        while group is not None and _group_alive(group):
            if time.monotonic() > deadline:
                if killed:
                    break  # stuck in the kernel: nothing more a signal can do
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(group, signal.SIGKILL)
                deadline, killed = time.monotonic() + 5, True
            time.sleep(0.1)
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def log_tail(self, lines: int = 30) -> str:
        return self.process.log_tail(lines)


def _group_alive(group: int) -> bool:
    """Whether any live (non-zombie) process is in process group `group` (Linux /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # exited while we looked
            continue
        # After the command name's last ')': state, ppid, pgrp, ...
        state, _ppid, pgrp = text.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) == group and state != "Z":
            return True
    return False


def start_server(
    tracking_uri: str,
    home: Path,
    ref: ModelRef,
    host: str = "127.0.0.1",
    port: int | None = None,
    workers: int = 1,
    timeout_s: float = START_TIMEOUT_S,
    say: Callable[[str], None] = lambda _: None,
    unconfined: bool = False,
) -> ModelServer:
    """Start serving `ref` and return once it answers /ping; stopped again if it never does.
    `unconfined`: where no box can be made, serve a version without an approval anyway."""
    # The scoring server loads a pyfunc model, which needs pandas: the full mlflow brings it.
    require_extra("control", "forgeline serve")
    registered = _registered(tracking_uri, ref)
    # A server on every interface is reached through loopback from here.
    local = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    if port is None:
        port = free_port()
    elif port_is_open(local, port):
        raise ServeError(f"port {port} on {host} is in use: pass another --port, or none")
    # One folder (and log, and pid file) per port: two servers of one model may run side by side.
    process = ManagedProcess(home, f"serve-{ref.name}-{port}")
    scratch = home / "serving" / process.name
    shutil.rmtree(scratch, ignore_errors=True)  # what a stopped server left: made afresh
    verified = _verified_folder(tracking_uri, ref, registered.number, scratch / "model")
    door = scratch / "door"  # the model's unix socket, which the relay serves on the port
    door.mkdir()
    model = _place(ref, registered, verified, scratch / "tmp", unconfined, say, door)
    how = "in a box" if model.box is not None else "unboxed"
    say(
        f"starting the model server for {ref} (version {registered.number}, {verified.summary}) "
        f"from {verified.path}, {how}"
    )
    process.log_file.unlink(missing_ok=True)
    argv = model_box.serve_command(model, host, port, workers, door)
    process.start(argv, env=model.environment(), cwd=door, inherit_env=False)
    url = f"http://[{local}]:{port}" if ":" in local else f"http://{local}:{port}"
    server = ModelServer(ref, registered.number, url, process, scratch)
    try:
        _wait_ready(server, timeout_s)
    except BaseException:  # failed, or Ctrl-C while it starts: leave nothing behind
        server.stop()
        raise
    return server


def _place(
    ref: ModelRef,
    registered: Registered,
    verified: VerifiedFolder,
    tmp: Path,
    unconfined: bool,
    say: Callable[[str], None],
    serves: Path | None = None,
) -> model_box.ModelPlace:
    """Where the version's code will run (worker.model_box), said before it runs when that is
    not a box; refused, naming the fix, where it may not run at all."""
    what = registered.describe(ref)
    try:
        model = model_box.place(verified.path, tmp, what, registered.approved, unconfined, serves)
    except model_box.ModelProcessError as err:
        raise ServeError(str(err)) from None
    if model.note:
        say(model.note)
    return model


def _wait_ready(server: ModelServer, timeout_s: float) -> None:
    # /ping answers 200 only once the model is loaded, so "ready" means ready to generate.
    deadline = time.monotonic() + timeout_s
    while not http_ok(f"{server.url}/ping"):
        if not server.running():
            raise ServeError(
                f"the model server for {server.ref} exited during start-up "
                f"(log: {server.process.log_file})",
                server.log_tail(),
            )
        if time.monotonic() > deadline:
            raise ServeError(
                f"the model server for {server.ref} did not answer {server.url}/ping within "
                f"{timeout_s:.0f} s (log: {server.process.log_file})",
                server.log_tail(),
            )
        time.sleep(0.2)


def curl_example(url: str, prompt: str = "ROMEO:", max_new_tokens: int = 100) -> str:
    body = json.dumps({"inputs": [prompt], "params": {"max_new_tokens": max_new_tokens, "seed": 0}})
    return f"curl -s {url}/invocations -H 'Content-Type: application/json' -d {shlex.quote(body)}"


def generate_local(
    tracking_uri: str,
    ref: ModelRef,
    prompt: str,
    max_new_tokens: int,
    seed: int,
    say: Callable[[str], None] = lambda _: None,
    unconfined: bool = False,
) -> str:
    """Continue `prompt` with the registered model, loaded in a process of its own
    (worker.model_box): this process downloads and verifies the version's folder, the model's
    process, boxed where it can be, loads it and answers over a pipe. `unconfined`: where no
    box can be made, run a version without an approval anyway."""
    # The model's process loads a pyfunc model, which needs pandas: the full mlflow brings it.
    require_extra("control", "forgeline generate without --url")
    registered = _registered(tracking_uri, ref)
    with tempfile.TemporaryDirectory(prefix="forgeline-generate-") as scratch:
        verified = _verified_folder(tracking_uri, ref, registered.number, Path(scratch) / "model")
        if verified.unchecked:  # said before its code runs, not only after
            say(f"{ref} (version {registered.number}): {verified.summary}")
        model = _place(ref, registered, verified, Path(scratch) / "tmp", unconfined, say)
        params = {"max_new_tokens": max_new_tokens, "seed": seed}
        try:
            return model_box.generate(model, prompt, params)
        except model_box.ModelProcessError as err:
            raise ServeError(f"{ref} (version {registered.number}): {err}", err.log_tail) from None


def _verified_folder(tracking_uri: str, ref: ModelRef, version: str, dest: Path) -> VerifiedFolder:
    shutil.rmtree(dest, ignore_errors=True)  # a folder a stopped server left: fetched afresh
    dest.mkdir(parents=True)
    try:
        return fetch_verified(tracking_uri, ref.name, version, dest)
    except UnverifiedModel as err:
        raise ServeError(str(err)) from None


def generate_remote(
    url: str, prompt: str, max_new_tokens: int, seed: int, timeout_s: float = 300.0
) -> str:
    """Ask a running model server (`forgeline serve`) to continue `prompt`."""
    url = url.rstrip("/")
    try:
        parts = urllib.parse.urlsplit(url)
        usable = parts.scheme in ("http", "https") and bool(parts.hostname)
    except ValueError:  # e.g. an unclosed IPv6 bracket
        usable = False
    if not usable:  # urllib would raise ValueError ("unknown url type") for these
        raise ServeError(
            f"--url {url[:100]!r} is not a model server's address: use http://HOST:PORT as "
            "`forgeline serve` prints it"
        )
    body = {"inputs": [prompt], "params": {"max_new_tokens": max_new_tokens, "seed": seed}}
    request = urllib.request.Request(
        f"{url}/invocations",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")
        with contextlib.suppress(json.JSONDecodeError, AttributeError):
            detail = json.loads(detail).get("message", detail)
        raise ServeError(f"the model server at {url} answered {err.code}: {detail[:300]}") from None
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise ServeError(
            f"cannot reach the model server at {url} ({reason}): start one with "
            "`forgeline serve MODEL`, or drop --url to run the model here"
        ) from None
    except json.JSONDecodeError:
        raise ServeError(f"{url}/invocations did not answer JSON: is it a model server?") from None
    predictions = answer.get("predictions") if isinstance(answer, dict) else None
    if not isinstance(predictions, list) or not predictions:
        raise ServeError(f"{url}/invocations answered {str(answer)[:200]}, not predictions")
    return str(predictions[0])


def wait_in_foreground(server: ModelServer, poll_s: float = 0.5) -> None:
    """Block until the server exits by itself (ServeError with its log) or we are interrupted."""
    while server.running():
        time.sleep(poll_s)
    raise ServeError(
        f"the model server for {server.ref} stopped by itself (log: {server.process.log_file})",
        server.log_tail(),
    )
