"""What a user's own script costs at the two places Forgeline adds work, side by side with the
baseline in one run (issue 46's benchmark).

    python -m bench.byo [--repeats 3] [--skip-envs] [--skip-starts] [--skip-checkpoints]

1. A node's start with a code folder's own environment (infra.user_envs), for
   examples/byo/hf/requirements.txt (transformers, accelerate): built with an empty uv cache
   (everything downloaded from the package index), built with the uv cache warm (another node
   of the same host), reused (the environment is there), against a folder whose requirements
   the node meets (examples/byo/gru: the node's own interpreter). As the node agent does it
   (activities.fetch: NodeCache.environment). Node-side only: the time before the ranks can
   start. Then submission to first step through a private stack, built, reused, none needed,
   and in a container image (bench/byo_start.py, which says how).
2. A checkpoint of the same ~60 M-parameter GPT with AdamW state (bench.trainer's): a script
   that keeps its own checkpoints (level 1) blocks its loop for its own `torch.save` into its
   folder, then the node agent commits the folder (copy, sha256, upload, manifest last:
   trainer.folder_watch) while the script trains on; against the SDK's asynchronous save, which
   blocks the loop for the staging copy (overlapped with the next forward and backward) and
   commits in the background. Stall: what the training loop waits; save to commit: from the
   save's start until the manifest is in the store.

The SDK's overhead per step against a bare loop is bench/trainer.py's throughput table
(`python -m bench.trainer --skip-checkpoint`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from activities.fetch import NodeCache
from bench import byo_start
from bench.trainer import big_model_in_a_gang_of_one, overlapped_save, table
from infra.store.local import LocalStore
from trainer.checkpoint import Checkpointer
from trainer.folder_checkpoint import CommitTarget
from trainer.folder_watch import FolderWatcher

REPO = Path(__file__).resolve().parents[1]
WITH_REQUIREMENTS = REPO / "examples" / "byo" / "hf"
WITHOUT = REPO / "examples" / "byo" / "gru"


def _timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def _environment_of(code: Path, cache_root: Path) -> float:
    """Seconds the node agent takes to have `code`'s environment ready (activities.fetch:
    built, reused, or none needed), with its node cache at `cache_root`."""
    cache = NodeCache(cache_root, LocalStore(cache_root / "store"), 10**11)
    started = time.perf_counter()
    with cache.lease() as lease:
        env = lease.environment(code)
    took = time.perf_counter() - started
    assert (env is None) == (code == WITHOUT), f"{code}: environment {env}"
    return took


def environments(root: Path, repeats: int) -> list[tuple[str, str, str, str]]:
    cold, warm, reused, none = [], [], [], []
    for i in range(repeats):
        # An empty uv cache: what the first node of a host pays (everything downloaded).
        os.environ["UV_CACHE_DIR"] = str(root / f"uv-cache-{i}")
        cold.append(_environment_of(WITH_REQUIREMENTS, root / f"node-{i}"))
        # The same packages, the uv cache warm: another node's build on this host.
        warm.append(_environment_of(WITH_REQUIREMENTS, root / f"node-{i}-again"))
        reused.append(_environment_of(WITH_REQUIREMENTS, root / f"node-{i}-again"))
        # Requirements the node meets (examples/byo/gru: torch>=2.6): the node's interpreter.
        none.append(_environment_of(WITHOUT, root / f"node-{i}-again"))
    os.environ.pop("UV_CACHE_DIR", None)
    med, baseline = statistics.median, f"{statistics.median(none):.4f} none needed"
    return [
        ("environment, empty uv cache (s)", f"{med(cold):.2f}", baseline, f"+{med(cold):.1f} s"),
        ("environment, warm uv cache (s)", f"{med(warm):.2f}", baseline, f"+{med(warm):.1f} s"),
        ("environment, reused (s)", f"{med(reused):.4f}", baseline,
         f"+{(med(reused) - med(none)) * 1e3:.0f} ms"),
    ]  # fmt: skip


def checkpoints(root: Path, repeats: int) -> list[tuple[str, str, str, str]]:
    model, optimizer = big_model_in_a_gang_of_one()
    sdk = Checkpointer(store=LocalStore(root / "sdk-store"), staging_dir=root / "staging",
                       run_id="big", generation=1, keep=2, layout={})  # fmt: skip
    folder = root / "script-folder"
    folder.mkdir()
    watcher = FolderWatcher(folder, root / "folder-staging", LocalStore(root / "folder-store"),
                            CommitTarget("big", 1, ""), last_step=0, keep=2)  # fmt: skip
    sdk_stall, sdk_commit, own_stall, own_commit = [], [], [], []
    for i in range(repeats):
        stall, committed = overlapped_save(sdk, model, optimizer, step=i + 1)
        sdk_stall.append(stall)
        sdk_commit.append(committed)

        # A script as it is: its own torch.save (the loop waits), then the agent's commit.
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": i}
        started = time.perf_counter()
        torch.save(state, folder / "last.pt")
        saved = time.perf_counter()
        poll = watcher.final(i + 1, unchanged_too=True)
        assert poll.commit is not None and poll.commit.step == i + 1, poll
        own_stall.append(saved - started)
        own_commit.append(time.perf_counter() - started)
    sdk.close()
    dist.destroy_process_group()
    med = statistics.median
    size = (folder / "last.pt").stat().st_size / 2**20
    print(f"checkpoint: {size:.0f} MiB (model and AdamW state) as one torch.save file")
    return [
        _pair("loop stall per save (s)", med(own_stall), med(sdk_stall)),
        _pair("save to commit (s)", med(own_commit), med(sdk_commit)),
    ]


def _pair(measure: str, own: float, sdk: float) -> tuple[str, str, str, str]:
    return (measure, f"{own:.3f} script's folder", f"{sdk:.3f} SDK async", f"{own / sdk:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-envs", action="store_true")
    parser.add_argument("--skip-starts", action="store_true", help="no stack (bench.byo_start)")
    parser.add_argument("--skip-checkpoints", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="forgeline-bench-byo-") as tmp:
        root = Path(tmp)
        if not args.skip_envs:
            rows += environments(root / "envs", args.repeats)
        if not args.skip_starts:  # the same environments through the stack, and an image
            rows += byo_start.rows(byo_start.measure(root / "starts", args.repeats)[0])
        if not args.skip_checkpoints:
            rows += checkpoints(root / "checkpoints", args.repeats)
    print(table(rows))


if __name__ == "__main__":
    main()
