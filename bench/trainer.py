"""What the platform costs a training run, side by side with bare PyTorch in one run.

    python -m bench.trainer [--repeats 3] [--skip-throughput] [--skip-checkpoint]

1. Throughput at two sizes, a small GPT (4 layers × 128, batch 12 × 64 tokens: what the
   platform adds per step shows) and today's (4 × 256, batch 16 × 128): the built-in trainer
   through the SDK (real torchrun, one rank, every always-on feature: the deterministic sampler,
   the per-step decisions, stop checks, goodput ledger, progress file) against
   `bench/bare_loop.py`, the plainest loop of the same model, batch and data, with the same
   threads; and, in that same bare loop, the built-in GPT against a network of the same shape
   with one plain fused qkv and no biases (`bench/fused_gpt.py`), and the GPT's former layout
   (separate q, k, v with biases) against that same network. Tokens/s after a warm-up, best and
   median of `--repeats`, alternating, the order reversed every other repeat; ratios are best
   over best and the median of each repeat's adjacent pair. A run's figure is its median
   window of 10 steps (a burst of other work on a shared machine moves a few windows, not the
   median); the ms/step lines also show each run's figure over all its steps. And, measured
   inside each SDK run (so the machine's speed, which swings by a quarter from minute to
   minute on a shared 2-core VM, moves it little): the share of the step the ranks spent in
   the SDK's own per-step code (sampler, decisions, stop checks, progress; not the gradient
   norm, which is the clipping a bare loop does too), worst and median run, and the ratio that
   code alone would leave. It leaves out what the SDK may cost outside its code: its threads,
   the process group, a forked rank.
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
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from dataprep.filters import FilterSettings
from dataprep.settings import SnapshotSettings
from dataprep.snapshot import prepare_snapshot
from infra.processes import free_port
from infra.store.local import LocalStore
from trainer.checkpoint import Checkpointer, fetch_checkpoint, load_training_state
from trainer.job import TrainJob
from trainer.launch import Rendezvous, run_ranks
from trainer.manifest import find_latest
from trainer.model import GPT, GPTConfig
from workflows.contracts.spec import ModelSpec, RecoverySpec, TrainSpec

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "examples" / "data" / "tinyshakespeare.txt"
THREADS = max(1, min(2, os.cpu_count() or 1))
BIG = GPTConfig(vocab_size=8192, n_layer=8, n_head=12, n_embd=768, block_size=256)


def table(rows: list[tuple[str, str, str, str]]) -> str:
    header = ("measure", "subject", "baseline", "ratio")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join(
        [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)]
    )


# --- 1. throughput -----------------------------------------------------------------------


@dataclass(frozen=True)
class Size:
    label: str
    model: ModelSpec
    batch: int
    measured_steps: int  # after WARMUP steps


SIZES = (
    Size("small, 4 × 128, batch 12 × 64", ModelSpec(n_layer=4, n_head=4, n_embd=128, block_size=64),
         batch=12, measured_steps=200),
    # 120 steps, 12 windows: with 4 windows (40 steps) one burst of other work on this shared
    # machine moved a run's median window by up to 8 %, more than the gap being measured.
    Size("today's, 4 × 256, batch 16 × 128",
         ModelSpec(n_layer=4, n_head=4, n_embd=256, block_size=128), batch=16, measured_steps=120),
)  # fmt: skip
WARMUP = 10  # steps before the clock starts; also the trainer's log_every (the spec's default)


@dataclass(frozen=True)
class Measured:
    """One run's tokens/s: over all its measured steps, and in each window of WARMUP steps;
    for the SDK trainer also, in each window, the share of the time its ranks spent in the
    SDK's own per-step code (the progress file's `sdk_share`)."""

    whole: float
    windows: list[float]
    sdk_shares: list[float] = field(default_factory=list)

    @property
    def typical(self) -> float:
        """The median window: what the loop costs when the machine is not busy elsewhere. On
        a shared 2-core machine a burst of someone else's work moves a whole run's figure by
        up to 30 % and lands on either side at random; it moves a few windows, not the median."""
        return statistics.median(self.windows)


def _vocab(snapshot) -> int:
    return snapshot.manifest.tokenizer.vocab_size


def _train_shards(store: LocalStore, snapshot) -> list[str]:
    return [str(store.root / s.key) for s in snapshot.manifest.splits["train"].shards]


def trainer_tokens_per_s(
    root: Path, store: LocalStore, snapshot, size: Size, run: str, ranks: int = 1, **fields: object
) -> Measured:
    """The built-in trainer's tokens/s over `ranks` ranks on one node (each with THREADS //
    ranks threads; DDP unless `fields` has a layout); `fields` go into the job as a node agent
    would set them."""
    steps = WARMUP + size.measured_steps
    threads = max(1, THREADS // ranks)
    train = TrainSpec(
        steps=steps, batch_size=size.batch, log_every=WARMUP, checkpoint_every=steps,
        threads_per_rank=threads, warmup_steps=2,
    )  # fmt: skip
    work = root / run
    job = TrainJob(
        run_id=run,
        node_id="n0",
        generation=1,
        model={**size.model.architecture(), "vocab_size": _vocab(snapshot)},
        train=train.model_dump(),
        train_shards=_train_shards(store, snapshot),
        dtype=snapshot.manifest.dtype,
        store_url=store.url,
        staging_dir=str(work / "staging"),
        progress_file=str(work / "progress.jsonl"),
        # As a node agent writes it for `forgeline run`: the files the ranks watch every step.
        stop_file=str(work / "STOP"),
        chaos_file=str(work / "CHAOS"),
        layout=fields.pop("layout", {"replicate": ranks, "shard": 1, "tensor": 1}),
        stragglers=RecoverySpec().straggler_settings(),
        spikes=RecoverySpec().spike_settings(),
        **fields,
    )
    rdzv = Rendezvous(f"127.0.0.1:{free_port()}", run, 1, ranks)
    asyncio.run(run_ranks(job, work, rdzv, lambda _: None, threads_per_rank=threads))
    events = {
        e["step"]: e
        for e in map(json.loads, Path(job.progress_file).read_text().splitlines())
        if e["event"] == "step"
    }
    tokens = size.batch * size.model.block_size
    grid = range(WARMUP, steps + 1, WARMUP)
    marks = [events[s]["time"] for s in grid]
    return Measured(
        whole=size.measured_steps * tokens / (marks[-1] - marks[0]),
        windows=[WARMUP * tokens / (b - a) for a, b in itertools.pairwise(marks)],
        sdk_shares=[events[s]["sdk_share"] for s in grid[1:]],
    )


def bare_tokens_per_s(store: LocalStore, snapshot, size: Size, arch: str) -> Measured:
    shard = _train_shards(store, snapshot)[0]
    model = json.dumps({**size.model.architecture(), "vocab_size": _vocab(snapshot)})
    out = subprocess.run(
        [sys.executable, "-m", "bench.bare_loop", str(shard), snapshot.manifest.dtype, model,
         str(size.batch), str(WARMUP + size.measured_steps), str(THREADS),
         "--warmup", str(WARMUP), "--arch", arch],
        cwd=REPO, capture_output=True, text=True, check=True,
        env={**os.environ, "OMP_NUM_THREADS": str(THREADS)},
    )  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return Measured(whole=result["tokens_per_s"], windows=result["window_tokens_per_s"])


def _row(measure: str, ours: list[Measured], base: list[Measured]) -> tuple[str, str, str, str]:
    """Best and median over the repeats of each run's median window; the ratio of the bests
    and the median of the ratios of each repeat's adjacent runs (which drift in the machine's
    speed cancels)."""
    ours, base = [m.typical for m in ours], [m.typical for m in base]
    cell = lambda v: f"{max(v):,.0f} / {statistics.median(v):,.0f}"  # noqa: E731
    paired = statistics.median(o / b for o, b in zip(ours, base, strict=True))
    return (measure, cell(ours), cell(base), f"{max(ours) / max(base):.3f} / {paired:.3f}")


def throughput(root: Path, repeats: int) -> list[tuple[str, str, str, str]]:
    store = LocalStore(root / "store")
    settings = SnapshotSettings(filters=FilterSettings(min_words=1))
    snapshot = prepare_snapshot([str(CORPUS)], settings, store, root / "dataprep")
    kinds = ("trainer", "gpt", "fused", "separate")
    runs = {(size.label, kind): [] for size in SIZES for kind in kinds}
    for attempt in range(repeats):
        for s, size in enumerate(SIZES):
            # Alternate, and reverse the order every other repeat: drift favours no one.
            for kind in kinds if attempt % 2 == 0 else kinds[::-1]:
                runs[size.label, kind].append(
                    trainer_tokens_per_s(root, store, snapshot, size, f"bench-{s}-{attempt}")
                    if kind == "trainer"
                    else bare_tokens_per_s(store, snapshot, size, kind)
                )
    rows = []
    for size in SIZES:
        tokens = size.batch * size.model.block_size
        for figure in ("typical", "whole"):
            ms = {k: [round(1e3 * tokens / getattr(m, figure), 1) for m in runs[size.label, k]]
                  for k in kinds}  # fmt: skip
            print(f"{size.label}: ms/step ({figure}), "
                  + "; ".join(f"{k} {ms[k]}" for k in kinds))  # fmt: skip
        shares = [statistics.median(m.sdk_shares) for m in runs[size.label, "trainer"]]
        rows += [
            _row(f"tokens/s, {size.label}: SDK trainer vs bare loop", runs[size.label, "trainer"],
                 runs[size.label, "gpt"]),
            # Measured inside each trainer run, so the machine's swings move it little: the
            # ratio that the SDK's own per-step code alone would leave (1 - its share).
            (f"SDK's own per-step work, {size.label}: share of the step",
             f"{max(shares):.2%} / {statistics.median(shares):.2%}", "-",
             f"{1 - max(shares):.3f} / {1 - statistics.median(shares):.3f}"),
            _row(f"tokens/s, {size.label}: GPT vs fused qkv, no biases (bare loop)",
                 runs[size.label, "gpt"], runs[size.label, "fused"]),
            _row(f"tokens/s, {size.label}: GPT's former layout vs fused qkv, no biases",
                 runs[size.label, "separate"], runs[size.label, "fused"]),
        ]  # fmt: skip
    return rows


# --- 2. and 3. checkpoints ----------------------------------------------------------------


def _one_step(model: GPT, optimizer: torch.optim.Optimizer, batch: int) -> None:
    x = torch.randint(0, BIG.vocab_size, (batch, 128))
    _, loss = model(x, x)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def big_model_in_a_gang_of_one() -> tuple[GPT, torch.optim.Optimizer]:
    """The ~60 M-parameter GPT with its AdamW moments, in a gloo group of this process alone:
    what a checkpoint benchmark saves (bench/door.py too)."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    model = GPT(BIG)
    optimizer = model.optimizer(1e-4, 0.1)
    _one_step(model, optimizer, 1)  # AdamW moments exist from here
    return model, optimizer


def overlapped_save(
    checkpointer: Checkpointer, model: GPT, optimizer: torch.optim.Optimizer, step: int
) -> tuple[float, float]:
    """One asynchronous save as the SDK's loop does it: save, the next forward and backward,
    then wait for the staging copy. Returns the loop's stall and the save's time to commit."""
    started = time.perf_counter()
    checkpointer.save(model, optimizer, step=step, meta={})
    blocked = time.perf_counter() - started
    x = torch.randint(0, BIG.vocab_size, (1, 128))
    _, loss = model(x, x)
    loss.backward()
    started = time.perf_counter()
    checkpointer.before_weights_change()
    stall = blocked + time.perf_counter() - started
    optimizer.zero_grad(set_to_none=True)
    report = checkpointer.wait()
    assert report is not None and report.manifest_key is not None
    return stall, report.total_s


def checkpoints(root: Path, repeats: int) -> list[tuple[str, str, str, str]]:
    model, optimizer = big_model_in_a_gang_of_one()
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

        stall, committed = overlapped_save(checkpointer, model, optimizer, step=2 * i + 1)
        stall_overlap.append(stall)
        commit.append(committed)

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
    parser.add_argument("--repeats", type=int, default=3)
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
