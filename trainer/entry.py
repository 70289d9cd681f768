"""The torchrun entry of every rank: runs the rank script, the built-in GPT trainer or a user's.

    python -m torch.distributed.run ... --start-method fork --run-path .../trainer/entry.py JOB.json

A script that fails before its first step (it cannot be imported, raises while it sets up, or
returns without training) fails the same way on every attempt and on every node: that is the
user's error, not a node's. This entry tells them apart: such a failure becomes one
`user_error` line in the progress file, with the end of the traceback and the script's file
and line, and the exit status EXIT_USER_ERROR; the node agent then fails the run at once instead
of draining nodes and burning restarts. A failure after training began is a crash like any
other (restart from the last committed checkpoint, bounded by recovery.max_restarts), and so
is any failure of the fabric (a peer gone from a collective or the rendezvous), whenever it
happens.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import TextIO

import setproctitle

from trainer.job import TrainJob
from trainer.platform_faults import is_broken_node, is_device_fault, is_fabric_fault
from trainer.progress import ProgressFile
from trainer.rank_logs import rank_log_name
from trainer.user_module_names import make_way_for

BUILT_IN = "trainer.train:main"
EXIT_USER_ERROR = 4
_TRACEBACK_CHARS = 3000
_REASON_CHARS = 500


class _Progress:
    """Whether this rank's script has finished a step yet (forgeline.training marks it)."""

    began = False
    stacks: TextIO = sys.stderr  # faulthandler writes to it; it stays open while the rank lives


def mark_began() -> None:
    _Progress.began = True


def _where(tb: list[traceback.FrameSummary], code_dir: str) -> str:
    """The user's own frame nearest the error (file relative to the code folder, line)."""
    if code_dir:
        inside = [f for f in tb if f.filename.startswith(code_dir)]
        if inside:
            frame = inside[-1]
            return f"{Path(frame.filename).relative_to(code_dir)}, line {frame.lineno}"
    if tb:
        return f"{tb[-1].filename}, line {tb[-1].lineno}"
    return "(no frame)"


def _report(job: TrainJob, event: str, **fields: str | bool | int) -> None:
    """One progress line, from whichever rank found it (appends of a line are atomic)."""
    if not job.progress_file:
        return
    line = {"time": time.time(), "event": event, **fields}
    with open(job.progress_file, "a") as handle:
        handle.write(json.dumps(line) + "\n")


def _run_entrypoint(job: TrainJob, entry: str) -> None:
    code_dir = job.code_dir
    if code_dir:
        # The script's own modules import as they do at home, `trainer.py` and `infra/` too.
        make_way_for(Path(code_dir), job.store_url, job.twin_store_url)
        sys.path.insert(0, code_dir)
    if entry.endswith(".py"):
        path = Path(code_dir) / entry
        sys.argv = [str(path), *job.script_argv]
        runpy.run_path(str(path), run_name="__main__")
        return
    module, _, function = entry.partition(":")
    sys.argv = [module, *job.script_argv]
    getattr(importlib.import_module(module), function)()


def _print_stacks_when_asked(job: TrainJob) -> None:
    """`kill -USR1 <rank pid>` prints every thread's stack to the rank's stacks file: the
    first thing to look at when a gang hangs in a collective, and where a script's own set-up
    that never ends is found (trainer.start_watch). Set before the script's first line."""
    path = job.stacks_file(int(os.environ.get("LOCAL_RANK", "0")))
    _Progress.stacks = open(path, "a") if path else sys.stderr  # noqa: SIM115 (open for life)
    faulthandler.register(signal.SIGUSR1, file=_Progress.stacks, all_threads=True)


def _copy_output_to_rank_log(job: TrainJob) -> None:
    """Everything this rank prints, from Python or from C, also goes to its own log file (the
    node agent ships it to the store: trainer.rank_logs), and still to torchrun's log. A `tee`
    process does the copying: it outlives a rank that crashes or is killed, so the traceback
    or the last lines before the end are never lost with the rank's own buffers."""
    if not job.progress_file:
        return
    rank = job.node_index * int(os.environ.get("LOCAL_WORLD_SIZE", "1")) + int(
        os.environ.get("LOCAL_RANK", "0")
    )
    path = Path(job.progress_file).parent / rank_log_name(rank)
    sys.stdout.flush()
    sys.stderr.flush()
    console, errors = os.dup(1), os.dup(2)  # torchrun's log, where the copy also goes
    tee = subprocess.Popen(
        _tee(path),
        stdin=subprocess.PIPE,
        stdout=console,
        stderr=errors,
        # A signal for the ranks' group (Ctrl-C at a terminal) must not end the copy first.
        start_new_session=True,
    )
    os.close(console)
    os.close(errors)
    assert tee.stdin is not None
    os.dup2(tee.stdin.fileno(), 1)
    os.dup2(tee.stdin.fileno(), 2)
    tee.stdin.close()  # fds 1 and 2 hold the pipe now; it closes when the rank exits


# `tee -a FILE` where an image has no coreutils (infra.containers): the same copy, in Python.
_PYTHON_TEE = """import os, sys
with open(sys.argv[1], "ab", buffering=0) as log:
    while chunk := os.read(0, 65536):
        log.write(chunk)
        os.write(1, chunk)
"""


def _tee(path: Path) -> list[str]:
    if shutil.which("tee") is not None:
        return ["tee", "-a", str(path)]
    return [sys.executable, "-c", _PYTHON_TEE, str(path)]


def _mark_the_script_s_start(job: TrainJob) -> None:
    """The start watch (trainer.start_watch) counts the script's own time from here, not from
    torchrun's launch: Python and torch importing is the platform's time."""
    progress = ProgressFile(job.progress_file, enabled=os.environ.get("LOCAL_RANK", "0") == "0")
    progress.write(event="sdk", call="script", state="entered")


def _began(job: TrainJob) -> bool:
    """Whether the script is past its set-up: it finished a step through the SDK, or, keeping
    its own checkpoints, it resumed from one or has written one (a script that fails before
    that fails the same way on every node: the user's error)."""
    if _Progress.began:
        return True
    folder = Path(job.checkpoint_folder) if job.checkpoint_folder else None
    return folder is not None and (
        job.checkpoint_resumed or (folder.is_dir() and any(folder.iterdir()))
    )


def _exited(job: TrainJob) -> None:
    """A script that keeps its own checkpoints returned: its folder is whole (the agent
    commits it once more even if the gang was stopped by a signal: trainer.script_folder)."""
    if job.checkpoint_folder:
        _report(job, "exited", rank=int(os.environ.get("RANK", "0")))


def main(job: TrainJob) -> None:
    _copy_output_to_rank_log(job)
    _print_stacks_when_asked(job)
    entry = job.train.get("entrypoint") or BUILT_IN
    _mark_the_script_s_start(job)
    try:
        _run_entrypoint(job, entry)
    except SystemExit as done:
        if done.code in (None, 0):
            _exited(job)
            raise
        if _began(job):
            raise
        fail_user(job, f"the rank script {entry} exited with status {done.code} before its "
                  "first step", "")  # fmt: skip
    except BaseException as err:
        if _began(job) or isinstance(err, KeyboardInterrupt):
            raise
        if is_fabric_fault(err) or is_device_fault(err):
            raise  # the node's or the fabric's: a crash, restarted, not the user's mistake
        frames = traceback.extract_tb(err.__traceback__)
        detail = "".join(traceback.format_exception(err))[-_TRACEBACK_CHARS:]
        where = _where(frames, job.code_dir)
        fail_user(job, f"the rank script {entry} failed before its first step: "
                  f"{type(err).__name__}: {err} ({where})", detail)  # fmt: skip
    if job.checkpoint_folder:
        _exited(job)
    elif not _Progress.began:
        fail_user(job, f"the rank script {entry} returned without training: it must call "
                  "run.steps() (see README, Your own training code)", "")  # fmt: skip


def fail_user(job: TrainJob, summary: str, detail: str) -> None:
    _report(job, "user_error", reason=summary, detail=detail)
    sys.stderr.write((detail or summary) + "\n")
    sys.exit(EXIT_USER_ERROR)


def as_a_fresh_rank(job_path: str) -> None:
    """Undo what a rank forked from torchrun inherits (trainer.launch). Its signal handlers
    raise torchrun's own exception: a SIGTERM before the SDK takes it over (a preemption during
    set-up) would read as the script's failure. And its command line: the rank names itself
    (`ps`, /proc) with this file, the job and its rank, which is how the chaos commands and the
    stop path tell ranks apart."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    setproctitle.setproctitle(
        f"{sys.executable} {Path(__file__).resolve()} {job_path} "
        f"(rank {os.environ.get('RANK', '?')})"
    )


def run_rank(job_path: str) -> None:
    """A rank, start to end. A forked rank's uncaught exception is not printed by the
    interpreter (torch's process wrapper keeps it for torchrun's summary): print it here, into
    the rank's log, as a fresh process's would be. Then say so in the progress file: the gang
    is lost (a peer gone from a collective, most often), and the node agent stops torchrun at
    once instead of waiting seconds for torchrun's own teardown (its monitor's next look, its
    rendezvous shutdown against a store whose host may be the dead node)."""
    as_a_fresh_rank(job_path)
    job = TrainJob.read(Path(job_path))
    try:
        main(job)
    except KeyboardInterrupt:  # torch's wrapper would make it a clean exit
        traceback.print_exc()
        raise SystemExit(130) from None
    except Exception as err:
        traceback.print_exc()
        sys.stderr.flush()  # before the agent, told below, stops this process
        # A device that says it is broken takes its node out of service (trainer.launch).
        _report(job, "crashed", reason=_one_line(err), node_fault=is_broken_node(err))
        raise


def _one_line(err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first}"[:_REASON_CHARS]


if __name__ == "__main__":
    # Through the imported module, not this `__main__` copy of it: the SDK marks progress on
    # `trainer.entry`, and that is the module whose state main() must read.
    from trainer import entry

    entry.run_rank(sys.argv[1])
