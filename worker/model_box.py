"""Where a registered version's own code runs when `forgeline generate` or `serve` loads it: in
a process of its own (worker.model_host), never in the caller's, and in a box where this host
can make one (infra.sandbox).

A version's serving entry, its shipped modules and anything its folder unpickles are its
submitter's code. Loaded in the approver's process, they would hold the approver's token and
environment: the model could approve itself as the person checking its samples. So the caller
downloads and verifies the folder, then starts the model's process with:

- a box: the Python environment and Forgeline's packages read-only, the verified model folder
  read-only, a private /tmp, no network (serve's unix socket folder writable, nothing else of
  the caller's: not its home, state folder or token file, no other process);
- an environment built from an allowlist (locale, thread counts, which GPUs; HOME and TMPDIR
  in its own /tmp): no FORGELINE_TOKEN, no AWS_*, no MLFLOW_TRACKING_*, no FORGELINE_TEMPORAL_*.

Prompts go in and samples come out over pipes (generate) or a unix socket (serve). Where bwrap
cannot box, a version with an approval record still loads, unboxed, in a process of its own
with the allowlisted environment; one without (a candidate) is refused unless the caller says
`--unconfined`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra import sandbox
from infra.sandbox import Box, SandboxUnavailable
from trainer.rank_box import PACKAGE_ROOT, PACKAGES

BOX_TMP = "/tmp"
MODEL_USER = "forgeline-model"
SOCKET = "model.sock"  # in the serve folder: the model's process listens, the relay connects
# All the caller's environment the model's process keeps: how text is encoded and time shown,
# how many threads, which accelerators. Everything else (tokens, keys, store and MLflow
# logins, Temporal's settings) stays behind, whatever its name.
KEPT_ENV = (
    "LANG", "LC_ALL", "LC_CTYPE", "TZ", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
)  # fmt: skip
ANSWER_LIMIT = 64 << 20  # bytes of one answer line: samples, not a flood into the caller
EXIT_WAIT_S = 30.0
LOG_TAIL_LINES = 30


class ModelProcessError(Exception):
    """The model's process was refused, failed or answered nonsense; the message says which."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail  # the model process's last lines of stderr, when it failed


@dataclass(frozen=True)
class ModelPlace:
    """Where one verified model folder's code runs: in `box`, or (None) unboxed."""

    folder: Path
    box: Box | None
    tmp: Path  # unboxed: its HOME and TMPDIR (a box has a /tmp of its own)
    note: str = ""  # why it is not boxed, for the caller to say; empty in a box

    def command(self, host_args: list[str], workdir: Path) -> list[str]:
        # -I: no PYTHON* variables, no user site, not the working folder on sys.path.
        inner = [sys.executable, "-I", "-u", "-m", "worker.model_host", *host_args]
        return self.box.argv(inner, str(workdir)) if self.box is not None else inner

    def environment(self) -> dict[str, str]:
        tmp = BOX_TMP if self.box is not None else str(self.tmp)
        kept = {name: os.environ[name] for name in KEPT_ENV if name in os.environ}
        return {
            **kept,
            # The venv's programs first: uvicorn's workers and MLflow look for them by name.
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}/usr/local/bin:/usr/bin:/bin",
            "HOME": tmp,
            "TMPDIR": tmp,
            "USER": MODEL_USER,
            "LOGNAME": MODEL_USER,
        }


def place(
    folder: Path, tmp: Path, what: str, approved: bool, unconfined: bool, serves: Path | None = None
) -> ModelPlace:
    """Box `folder`'s code where this host can; else run it unboxed if `what` is approved or
    the caller said `unconfined`; else refuse, saying why and what fixes it. `serves`: the
    folder of serve's unix socket, writable in the box."""
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        sandbox.check()
    except SandboxUnavailable as err:
        return ModelPlace(folder, None, tmp, _unboxed(what, str(err), approved, unconfined))
    box = Box(
        read_only=(
            *sandbox.python_paths(),
            *(str(PACKAGE_ROOT / name) for name in PACKAGES),
            str(folder),
        ),
        writable=(str(serves),) if serves is not None else (),
        network=False,
    )
    return ModelPlace(folder, box, tmp)


def _unboxed(what: str, why: str, approved: bool, unconfined: bool) -> str:
    # Unboxed, the model's process runs as the caller: its environment is clean, but the
    # caller's files and processes (their /proc/<pid>/environ) are its to read. Each line says so.
    if approved:
        return (
            f"{what} runs unboxed here: {why}; it is approved, so it runs in a process of its "
            "own with none of your secrets in its environment, but as your user"
        )
    if unconfined:
        return (
            f"{what} runs unboxed, as --unconfined asked: {why}; its environment holds none of "
            "your secrets, but it runs as your user and can read your files and your "
            "processes' environments, this command's token among them"
        )
    raise ModelProcessError(
        f"{what} has no approval, and its code cannot be boxed here: {why}; unboxed it would "
        "run as you and could read your files and your processes' environments, your token "
        "among them: make bwrap work, or pass --unconfined to run it anyway"
    )


def generate(model: ModelPlace, prompt: str, params: dict[str, Any]) -> str:
    """Start the model's process, ask it to continue `prompt`, and return its one sample."""
    log = model.tmp / "model.log"
    argv = model.command(["generate", str(model.folder)], Path(BOX_TMP) if model.box else model.tmp)
    with (
        open(log, "w+b") as errors,
        subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors,
            env=model.environment(), cwd=model.tmp,
        ) as proc,
    ):  # fmt: skip
        try:
            line = _ask(proc, {"inputs": [prompt], "params": params})
            status = proc.wait(timeout=EXIT_WAIT_S)
        finally:
            if proc.poll() is None:  # interrupted, or it would not stop: nothing outlives us
                proc.kill()
                proc.wait()
    tail = _tail(log)
    if not line:
        raise ModelProcessError(f"the model's process exited (status {status}) unanswered", tail)
    return _sample(line, tail)


def _ask(proc: subprocess.Popen[bytes], request: dict[str, Any]) -> bytes:
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(json.dumps(request).encode() + b"\n")
        proc.stdin.close()  # one request: the process ends after answering it
    except BrokenPipeError:  # it died before reading (its log says why)
        pass
    return proc.stdout.readline(ANSWER_LIMIT + 1)


def _sample(line: bytes, tail: str) -> str:
    if len(line) > ANSWER_LIMIT:
        raise ModelProcessError(f"the model answered more than {ANSWER_LIMIT >> 20} MiB", tail)
    try:
        answer = json.loads(line)
    except ValueError:
        answer = None
    if isinstance(answer, dict) and isinstance(answer.get("error"), str):
        raise ModelProcessError(f"the model failed: {answer['error'][:500]}", tail)
    predictions = answer.get("predictions") if isinstance(answer, dict) else None
    if not isinstance(predictions, list) or len(predictions) != 1:
        raise ModelProcessError(f"the model answered {line[:200]!r}, not one sample", tail)
    return str(predictions[0])


def serve_command(model: ModelPlace, host: str, port: int, workers: int, serves: Path) -> list[str]:
    """The command that serves the model on host:port: the relay (infra.socket_relay, run in
    `serves`) in front of the model's own scoring server on a unix socket there."""
    inner = model.command(
        ["serve", str(model.folder), "--socket", SOCKET, "--workers", str(workers)], serves
    )
    return [
        sys.executable, "-I", "-u", "-m", "infra.socket_relay",
        "--host", host, "--port", str(port), "--socket", SOCKET, "--", *inner,
    ]  # fmt: skip


def _tail(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-LOG_TAIL_LINES:])
