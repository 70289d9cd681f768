"""Pipeline parallelism and activation recomputation on this machine, and the planner's layout
for the seed job.

    python -m bench.pipeline [--repeats 3]

1. A 2-stage 1F1B pipeline against 2-replica DDP at the same global batch (the built-in GPT,
   4 × 128, 16 sequences of 128 tokens a step, 8 micro-batches; one thread a rank: this
   machine's two cores), in turns, the order reversed every other repeat: median step time
   of 15 steps after 3. The pipeline's measured bubble is 1 − (the slowest stage's forward and
   backward of the step's micro-batches alone) / (its step), against the schedule's theory,
   (P − 1)/(M + P − 1).
2. Activation recomputation, selective and full, against none: the GPT 8 × 256, 16 sequences
   of 256 tokens, dropout 0.1, one process: the peak memory a step adds to the model and its
   optimizer (the process's high-water mark, made before the steps with every state but the
   activations) and the median step time of 3 steps, in turns.
3. `forgeline plan --propose`'s best layout for the seed job (70 B, 4,096-token sequences,
   4,096 H100s) with its MFU estimate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.trainer import table
from infra.capacity import PRECISIONS, Shape
from infra.capacity_hardware import Hardware
from infra.capacity_layouts import propose
from infra.capacity_plan import Budget
from infra.processes import free_port

MICROBATCHES = 8
SEED_JOB = Shape(32000, n_layer=80, n_head=64, n_embd=8192, block_size=4096, rope=True,
                 swiglu=True, bias=False)  # fmt: skip


def _ranks(layout: str, out: Path) -> dict:
    port = free_port()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "-m", "bench.pipeline_ranks", "--layout", layout,
        "--microbatches", str(MICROBATCHES), "--out", str(out),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True)
    return json.loads(out.read_text())


def _one_process(mode: str, out: Path) -> dict:
    command = [
        sys.executable, "-m", "bench.pipeline_ranks", "--recompute", mode, "--layers", "8",
        "--width", "256", "--block", "256", "--batch", "16", "--steps", "3", "--out", str(out),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True)
    return json.loads(out.read_text())


def _ratio(ours: list[float], theirs: list[float]) -> str:
    pairs = [a / b for a, b in zip(ours, theirs, strict=True)]
    return f"{min(ours) / min(theirs):.3f} best, {statistics.median(pairs):.3f} median"


def pipeline_rows(folder: Path, repeats: int) -> list[tuple[str, str, str, str]]:
    runs: dict[str, list[dict]] = {"pp": [], "ddp": []}
    for repeat in range(repeats):
        for layout in ("pp", "ddp") if repeat % 2 == 0 else ("ddp", "pp"):
            runs[layout].append(_ranks(layout, folder / f"{layout}-{repeat}.json"))
    pp = [r["step_s"] for r in runs["pp"]]
    ddp = [r["step_s"] for r in runs["ddp"]]
    bubbles = [1 - r["solo_s"] / r["step_s"] for r in runs["pp"]]
    theory = 1 / (MICROBATCHES + 1)
    return [
        (
            f"step, 2-stage 1F1B (M = {MICROBATCHES}) vs 2-replica DDP",
            f"{statistics.median(pp) * 1000:.0f} ms",
            f"{statistics.median(ddp) * 1000:.0f} ms",
            _ratio(pp, ddp),
        ),
        (
            "pipeline bubble, measured vs (P − 1)/(M + P − 1)",
            f"{statistics.median(bubbles):.1%} (runs {min(bubbles):.1%}–{max(bubbles):.1%})",
            f"{theory:.1%}",
            f"{statistics.median(bubbles) / theory:.2f}",
        ),
    ]


def recompute_rows(folder: Path, repeats: int) -> list[tuple[str, str, str, str]]:
    modes = ("none", "selective", "full")
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for repeat in range(repeats):
        for mode in modes if repeat % 2 == 0 else tuple(reversed(modes)):
            runs[mode].append(_one_process(mode, folder / f"{mode}-{repeat}.json"))
    rows = []
    none_peak = [r["peak_added_mib"] for r in runs["none"]]
    none_step = [r["step_s"] for r in runs["none"]]
    for mode in ("selective", "full"):
        peak = [r["peak_added_mib"] for r in runs[mode]]
        step = [r["step_s"] for r in runs[mode]]
        rows.append((
            f"peak memory a step adds, {mode} recompute vs none",
            f"{statistics.median(peak):,.0f} MiB", f"{statistics.median(none_peak):,.0f} MiB",
            _ratio(peak, none_peak),
        ))  # fmt: skip
        rows.append((
            f"step time, {mode} recompute vs none",
            f"{statistics.median(step):.2f} s", f"{statistics.median(none_step):.2f} s",
            _ratio(step, none_step),
        ))  # fmt: skip
    return rows


def planner_rows() -> list[tuple[str, str, str, str]]:
    hardware = Hardware()
    best = propose(SEED_JOB, 4096, 8, Budget(10, 1024), PRECISIONS["bf16-mixed"], hardware)[0]
    return [
        (
            "seed job, 70 B on 4,096 H100s: proposed layout, MFU estimate vs assumed kernels",
            f"{best.describe()}: {best.mfu:.1%}",
            f"{hardware.mfu:.0%}",
            f"{best.mfu / hardware.mfu:.3f}",
        )
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        rows = pipeline_rows(folder, args.repeats) + recompute_rows(folder, args.repeats)
    print(table(rows + planner_rows()))


if __name__ == "__main__":
    main()
