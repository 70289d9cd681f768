"""What the platform costs a training run, side by side with bare PyTorch in one run.

    python -m bench.trainer [--repeats 2] [--skip-throughput] [--skip-checkpoint]

1. Throughput: the real trainer (torchrun, one rank, every always-on feature: the deterministic
   sampler, the per-step health all-gather, stop checks, progress file) against
   `bench/bare_loop.py`, the plainest loop of the same model, batch and data, with the same
   threads. Tokens/s after a warm-up; best of `--repeats`, alternating.
2. Checkpoint stall for a ~60 M-parameter GPT with AdamW state: the time the loop is blocked by
   an asynchronous save (with the copy overlapped with the next forward and backward, as the
   loop does it, and without overlap), against a synchronous `dcp.save` and a `torch.save` of the
   same state.
3. Time to resume from a manifest: find the newest verified manifest, fetch and sha256-check its
   files, load into model and optimizer; against a bare `dcp.load` of files already local.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from dataprep.filters import FilterSettings
from dataprep.settings import SnapshotSettings
from dataprep.snapshot import prepare_snapshot
from infra.processes import free_port
from infra.store import LocalStore
from trainer.checkpoint import Checkpointer, fetch_checkpoint, load_training_state
from trainer.job import TrainJob
from trainer.launch import Rendezvous, run_ranks
from trainer.manifest import find_latest
from trainer.model import GPT, GPTConfig
from workflows.spec import ModelSpec, TrainSpec

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "examples" / "data" / "tinyshakespeare.txt"
THREADS = max(1, min(2, os.cpu_count() or 1))
THROUGHPUT_MODEL = ModelSpec(n_layer=4, n_head=4, n_embd=256, block_size=128)
BATCH, STEPS, WARMUP = 16, 35, 5
BIG = GPTConfig(vocab_size=8192, n_layer=8, n_head=12, n_embd=768, block_size=256)


def table(rows: list[tuple[str, str, str, str]]) -> str:
    header = ("measure", "forgeline", "baseline", "ratio")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join(
        [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)]
    )


# --- 1. throughput -----------------------------------------------------------------------


def _vocab(snapshot) -> int:
    return snapshot.manifest["tokenizer"]["vocab_size"]


def _train_shards(store: LocalStore, snapshot) -> list[str]:
    return [str(store.root / s["key"]) for s in snapshot.manifest["splits"]["train"]["shards"]]


def trainer_tokens_per_s(root: Path, store: LocalStore, snapshot, attempt: int) -> float:
    train = TrainSpec(
        steps=STEPS, batch_size=BATCH, log_every=WARMUP, checkpoint_every=STEPS,
        threads_per_rank=THREADS, warmup_steps=2,
    )  # fmt: skip
    work = root / f"trainer-{attempt}"
    job = TrainJob(
        run_id=f"bench-{attempt}",
        node_id="n0",
        generation=1,
        model={**THROUGHPUT_MODEL.architecture(), "vocab_size": _vocab(snapshot)},
        train=train.model_dump(),
        train_shards=_train_shards(store, snapshot),
        dtype=snapshot.manifest["dtype"],
        store_url=store.url,
        staging_dir=str(work / "staging"),
        progress_file=str(work / "progress.jsonl"),
    )
    rdzv = Rendezvous(f"127.0.0.1:{free_port()}", f"bench-{attempt}", 1, 1)
    asyncio.run(run_ranks(job, work, rdzv, lambda _: None, threads_per_rank=THREADS))
    steps = {
        e["step"]: e["time"]
        for e in map(json.loads, Path(job.progress_file).read_text().splitlines())
        if e["event"] == "step"
    }
    tokens = (STEPS - WARMUP) * BATCH * THROUGHPUT_MODEL.block_size
    return tokens / (steps[STEPS] - steps[WARMUP])


def bare_tokens_per_s(store: LocalStore, snapshot) -> float:
    shard = _train_shards(store, snapshot)[0]
    model = json.dumps({**THROUGHPUT_MODEL.architecture(), "vocab_size": _vocab(snapshot)})
    out = subprocess.run(
        [sys.executable, "-m", "bench.bare_loop", str(shard), snapshot.manifest["dtype"], model,
         str(BATCH), str(STEPS), str(THREADS)],
        cwd=REPO, capture_output=True, text=True, check=True,
        env={**os.environ, "OMP_NUM_THREADS": str(THREADS)},
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"]


def throughput(root: Path, repeats: int) -> list[tuple[str, str, str, str]]:
    store = LocalStore(root / "store")
    settings = SnapshotSettings(filters=FilterSettings(min_words=1))
    snapshot = prepare_snapshot([str(CORPUS)], settings, store, root / "dataprep")
    ours, bare = [], []
    for attempt in range(repeats):
        ours.append(trainer_tokens_per_s(root, store, snapshot, attempt))
        bare.append(bare_tokens_per_s(store, snapshot))
    best, base = max(ours), max(bare)
    print(f"trainer tokens/s {[round(v) for v in ours]}, bare loop {[round(v) for v in bare]}")
    return [("tokens/s (1 rank, best)", f"{best:,.0f}", f"{base:,.0f}", f"{best / base:.3f}")]


# --- 2. and 3. checkpoints ----------------------------------------------------------------


def _one_step(model: GPT, optimizer: torch.optim.Optimizer, batch: int) -> None:
    x = torch.randint(0, BIG.vocab_size, (batch, 128))
    _, loss = model(x, x)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def checkpoints(root: Path, repeats: int) -> list[tuple[str, str, str, str]]:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    model = GPT(BIG)
    optimizer = model.optimizer(1e-4, 0.1)
    _one_step(model, optimizer, 1)  # AdamW moments exist from here
    params = sum(p.numel() for p in model.parameters())
    store = LocalStore(root / "ckpt-store")
    checkpointer = Checkpointer(
        store=store, staging_dir=root / "staging", run_id="big", generation=1, keep=2, layout={}
    )
    sync_dcp, sync_torch, stall_overlap, stall_bare, commit = [], [], [], [], []
    for i in range(repeats):
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        started = time.perf_counter()
        dcp.save(state, checkpoint_id=str(root / f"sync-{i}"))
        sync_dcp.append(time.perf_counter() - started)
        started = time.perf_counter()
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, root / "t.pt")
        sync_torch.append(time.perf_counter() - started)

        # As the loop does it: save, then the next forward and backward, then wait for the copy.
        started = time.perf_counter()
        checkpointer.save(model, optimizer, step=2 * i + 1, meta={})
        blocked = time.perf_counter() - started
        x = torch.randint(0, BIG.vocab_size, (1, 128))
        _, loss = model(x, x)
        loss.backward()
        started = time.perf_counter()
        checkpointer.before_weights_change()
        stall_overlap.append(blocked + time.perf_counter() - started)
        optimizer.zero_grad(set_to_none=True)
        report = checkpointer.wait()
        assert report is not None and report.manifest_key is not None
        commit.append(report.total_s)

        started = time.perf_counter()
        checkpointer.save(model, optimizer, step=2 * i + 2, meta={})
        checkpointer.before_weights_change()
        stall_bare.append(time.perf_counter() - started)
        checkpointer.wait()

    resume, bare_load = [], []
    for i in range(repeats):
        started = time.perf_counter()
        found = find_latest(store, "big", max_generation=1)
        assert found is not None
        folder = fetch_checkpoint(store, found.manifest, root / f"resume-{i}")
        load_training_state(model, optimizer, folder)
        resume.append(time.perf_counter() - started)
        model_state, optim_state = get_state_dict(model, optimizer)
        started = time.perf_counter()
        dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder))
        bare_load.append(time.perf_counter() - started)
    checkpointer.close()
    dist.destroy_process_group()

    med = statistics.median
    size = sum(f.stat().st_size for f in (root / "sync-0").iterdir()) / 2**20
    print(f"model: {params / 1e6:.1f} M parameters, checkpoint {size:.0f} MiB with AdamW state")
    return [
        ("stall, overlapped (s)", f"{med(stall_overlap):.3f}", f"{med(sync_dcp):.3f} dcp.save",
         f"1/{med(sync_dcp) / med(stall_overlap):.0f}"),
        ("stall, overlapped (s)", f"{med(stall_overlap):.3f}", f"{med(sync_torch):.3f} torch.save",
         f"1/{med(sync_torch) / med(stall_overlap):.0f}"),
        ("stall, no overlap (s)", f"{med(stall_bare):.3f}", f"{med(sync_dcp):.3f} dcp.save",
         f"1/{med(sync_dcp) / med(stall_bare):.0f}"),
        ("save to commit, background (s)", f"{med(commit):.3f}", f"{med(sync_dcp):.3f} dcp.save",
         f"{med(commit) / med(sync_dcp):.2f}"),
        ("resume from manifest (s)", f"{med(resume):.3f}", f"{med(bare_load):.3f} dcp.load",
         f"{med(resume) / med(bare_load):.2f}"),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-checkpoint", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        root = Path(tmp)
        if not args.skip_throughput:
            rows += throughput(root, args.repeats)
        if not args.skip_checkpoint:
            rows += checkpoints(root, max(args.repeats, 3))
    print(table(rows))


if __name__ == "__main__":
    main()
