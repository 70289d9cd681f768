"""What a boxed rank's store door costs a checkpoint, side by side with direct store writes.

    python -m bench.door [--repeats 5]        (make bench-door)

A ~60 M-parameter GPT with AdamW state (the checkpoint of bench/trainer.py), saved by the
Checkpointer the SDK uses, alternately straight to a folder store (what ranks did before they
were boxed) and through the store door (infra.store.door → trainer.store_door) to the same kind
of store, the door served by a separate process as the node agent serves it. Two figures for
each: the stall (the loop blocked by an asynchronous save, its copy overlapped with the next
forward and backward, as the loop does it) and save to commit (the background upload and the
manifest). Median and spread of `--repeats`, each repeat's pair in turn; the ratio is door
over direct.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from bench.trainer import big_model_in_a_gang_of_one, overlapped_save, table
from infra.store.door import DoorStore
from infra.store.local import LocalStore
from infra.store.protocol import ObjectStore
from trainer.checkpoint import Checkpointer
from trainer.store_door import DoorPolicy, StoreDoor

RUN = "bench-door"


def _serve(store_root: str, socket_path: str, run_dir: str, ready: multiprocessing.Event) -> None:
    """The node agent's side, in a process of its own."""
    policy = DoorPolicy(RUN, 1, Path(run_dir))
    with StoreDoor(LocalStore(Path(store_root)), policy, Path(socket_path)):
        ready.set()
        while True:
            time.sleep(3600)


def _checkpointer(store: ObjectStore, staging: Path) -> Checkpointer:
    return Checkpointer(
        store=store, staging_dir=staging, run_id=RUN, generation=1, keep=2, layout={}
    )


def measure(root: Path, repeats: int) -> list[tuple[str, str, str, str]]:
    run_dir = root / "run"
    run_dir.mkdir()
    socket_path = root / "door.sock"
    ready = multiprocessing.get_context("spawn").Event()
    agent = multiprocessing.get_context("spawn").Process(
        target=_serve, args=(str(root / "door-store"), str(socket_path), str(run_dir), ready),
        daemon=True,
    )  # fmt: skip
    agent.start()
    ready.wait(60)
    model, optimizer = big_model_in_a_gang_of_one()
    direct = _checkpointer(LocalStore(root / "direct-store"), run_dir / "staging-direct")
    door = _checkpointer(DoorStore(str(socket_path)), run_dir / "staging-door")
    figures: dict[str, list[tuple[float, float]]] = {"direct": [], "door": []}
    try:
        for warm_up in (direct, door):  # the staging buffers are made on a first save
            overlapped_save(warm_up, model, optimizer, step=1)
        for i in range(repeats):
            # Each repeat's pair in turn, the order swapped every other repeat.
            order = ("direct", "door") if i % 2 == 0 else ("door", "direct")
            for name in order:
                chosen = direct if name == "direct" else door
                figures[name].append(overlapped_save(chosen, model, optimizer, step=i + 2))
    finally:
        direct.close()
        door.close()
        dist.destroy_process_group()
        agent.kill()
    return [
        _row("checkpoint stall (s)", [f[0] for f in figures["door"]],
             [f[0] for f in figures["direct"]]),
        _row("save to commit (s)", [f[1] for f in figures["door"]],
             [f[1] for f in figures["direct"]]),
    ]  # fmt: skip


def _row(what: str, door: list[float], direct: list[float]) -> tuple[str, str, str, str]:
    med = statistics.median
    return (
        what,
        f"{med(door):.3f} ({min(door):.3f}–{max(door):.3f})",
        f"{med(direct):.3f} ({min(direct):.3f}–{max(direct):.3f}) direct",
        f"{med(door) / med(direct):.2f}",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-door-") as tmp:
        rows = measure(Path(tmp), args.repeats)
    print(table(rows))


if __name__ == "__main__":
    main()
