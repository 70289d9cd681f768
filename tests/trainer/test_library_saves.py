"""What the integrations (forgeline.integrations) rely on, without their libraries: a stop
request that every rank of a real gloo gang agrees on, the numbers a library logged turned into
reports, and a save the library says is complete committed at once, at its step, by the node
agent's watch (trainer.script_folder), where a folder left to itself waits to be quiet."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from forgeline.integrations.reported_metrics import reportable
from forgeline.integrations.stop_request import StopRequest
from forgeline.reporting import saved
from infra.processes import free_port
from infra.store.local import LocalStore
from tests.trainer.test_forgeline_report import a_fresh_process, in_a_job, written
from trainer.folder_checkpoint import CommitTarget
from trainer.folder_watch import FolderWatcher
from trainer.manifest import find_latest
from trainer.progress_tail import ProgressTail
from trainer.script_folder import ScriptFolder

__all__ = ["a_fresh_process"]  # the autouse fixture: each test starts as a new rank would


def _agree(rank: int, port: int, out: str) -> None:
    """One rank of a gloo gang of two: a step with no request, then rank 1 gets a SIGTERM and
    two more steps ask."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    stop = StopRequest()
    agreed = [stop.agreed()]
    if rank == 1:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler notes it; the process lives on
    dist.barrier()
    agreed += [stop.agreed() for _ in range(2)]  # every step asks; the answer stays
    Path(out, f"rank-{rank}").write_text(f"{stop.asked} {agreed}")
    dist.destroy_process_group()


def test_a_sigterm_to_one_rank_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    mp.spawn(_agree, args=(free_port(), str(tmp_path)), nprocs=2)
    said = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert said == {"rank-0": "False [False, True, True]", "rank-1": "True [False, True, True]"}


def test_a_library_s_log_becomes_numbers_under_forgeline_s_names() -> None:
    logged = {"loss": 2.5, "learning_rate": 1e-3, "epoch": 0.5, "eval_loss": torch.tensor(1.5),
              "total_flos": float("nan"), "note": "text", "done": True, "bad name!": 1.0,
              "grad": torch.ones(2)}  # fmt: skip
    renamed = {"learning_rate": "lr", "eval_loss": "val_loss"}
    assert reportable(logged, renamed) == {"loss": 2.5, "lr": 1e-3, "epoch": 0.5, "val_loss": 1.5}


def test_saved_writes_the_line_the_launch_follows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    progress = in_a_job(tmp_path, monkeypatch)
    saved(120)
    assert [(e["event"], e["step"]) for e in written(progress)] == [("saved", 120)]
    tail = ProgressTail(progress, world=1)
    tail.poll()
    assert tail.saved_step == 120


def a_busy_folder(tmp_path: Path) -> tuple[ScriptFolder, LocalStore, Path]:
    """A script folder whose settle period is an hour: only a save said complete commits."""
    store, folder = LocalStore(tmp_path / "store"), tmp_path / "checkpoint"
    folder.mkdir()
    watcher = FolderWatcher(folder, tmp_path / "staging", store, CommitTarget("lib", 1, ""),
                            last_step=0, settle_s=3600)  # fmt: skip
    progress = tmp_path / "progress.jsonl"
    script = ScriptFolder(folder, progress, watcher, tmp_path / "STOP", poll_s=0.05)
    return script, store, progress


def test_a_save_said_complete_is_committed_at_once_at_its_step(tmp_path: Path) -> None:
    script, store, progress = a_busy_folder(tmp_path)
    (script.folder / "checkpoint-120").mkdir()
    (script.folder / "checkpoint-120" / "model.safetensors").write_bytes(b"w" * 1000)
    progress.write_text('{"event": "step", "step": 130, "loss": 2.0}\n')

    async def watch(lines: str) -> None:
        with progress.open("a") as handle:
            handle.write(lines)
        tail = ProgressTail(progress, world=1)
        tail.poll()
        script.heard(tail)
        script.start()
        await asyncio.sleep(0.5)
        await script.stop()

    asyncio.run(watch(""))  # reported, but no save said complete: the folder waits
    assert find_latest(store, "lib", max_generation=1) is None
    asyncio.run(watch('{"event": "saved", "step": 120}\n'))
    committed = find_latest(store, "lib", max_generation=1)
    assert committed is not None and committed.step == 120  # the save's step, not the newest
    assert [f.name for f in committed.manifest.files] == ["checkpoint-120/model.safetensors"]


def test_a_save_said_complete_is_tried_once_then_the_settle_period_decides(
    tmp_path: Path,
) -> None:
    """The next save began before the watch came to this one (a file is open for writing):
    nothing is committed under the step that was said complete, then or later, until the
    folder settles or another save is said complete."""
    script, store, progress = a_busy_folder(tmp_path)
    progress.write_text('{"event": "saved", "step": 100}\n')
    tail = ProgressTail(progress, world=1)
    tail.poll()
    script.heard(tail)

    async def watch_while(writing: bool) -> None:
        with (script.folder / "last.ckpt").open("ab") as file:
            file.write(b"b" * 100)
            if not writing:
                file.close()
            script.start()
            await asyncio.sleep(0.4)
            await script.stop()

    asyncio.run(watch_while(writing=True))
    asyncio.run(watch_while(writing=False))  # closed now, but the save's one try is spent
    assert find_latest(store, "lib", max_generation=1) is None
