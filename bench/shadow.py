"""What the shadow checks cost a run and how soon they find a device that computes wrong.

    python -m bench.shadow [--repeats 3] [--steps 1200] [--layouts ddp,fsdp]

1. Throughput: the built-in trainer on two ranks (one thread each: this machine's two cores),
   DDP and FSDP, bench.trainer's small GPT, with `recovery.shadow_every` 50, 200 and 1000
   against no checks, in turns (the order reversed every other repeat). Under FSDP a check is
   one more forward and backward of the whole gang, with its all-gathers. Tokens/s is each
   run's median window of 10 steps; the ratio is best over best and the median of each
   repeat's pairs. The share of the training time the checks took is read from rank 0's own
   ledger (the goodput cause `shadow recompute`): measured inside each run, the machine's
   swings move it little, where tokens/s cannot resolve a tenth of a percent.
2. Detection: three ranks, one a node, checks every 50 steps. `forgeline chaos flip-bit` at a
   step (one weight's lowest bit, for good) is named at the next check (DDP; under FSDP every
   rank gathers the flipped weight alike, and the checks agree with it); `corrupt-grad
   --finite --scale 1.02` (one step's gradients 2 % too large on one rank) is named when it
   falls on a checked step, and otherwise leaves nothing to find: the reduction averaged it
   into every rank alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
from pathlib import Path

from bench.trainer import SIZES, Measured, Size, _row, table, trainer_tokens_per_s
from dataprep.filters import FilterSettings
from dataprep.settings import SnapshotSettings
from dataprep.snapshot import prepare_snapshot
from infra.store.local import LocalStore
from trainer.attempt_clock import ledger_key
from trainer.errors import RanksFailed
from workflows.contracts.spec import RecoverySpec

CORPUS = Path(__file__).resolve().parents[1] / "examples" / "data" / "tinyshakespeare.txt"
EVERY = (50, 200, 1000)
DETECT_EVERY = 50


def _layout(name: str, ranks: int) -> dict:
    return {"replicate": ranks if name == "ddp" else 1, "shard": ranks if name == "fsdp" else 1,
            "tensor": 1}  # fmt: skip


def _shadow(every: int) -> dict:
    return RecoverySpec(shadow_every=every).shadow_settings()


def _checks_share(store: LocalStore, run: str) -> float:
    totals = json.loads(store.get_bytes(ledger_key(run, 1)))["last"]["totals"]
    return totals["shadow_s"] / totals["train_s"]


def throughput(
    root: Path, store: LocalStore, snapshot, steps: int, repeats: int, layout: str
) -> list:
    size = Size(SIZES[0].label, SIZES[0].model, SIZES[0].batch, measured_steps=steps)
    kinds = (0, *EVERY)
    runs: dict[int, list[Measured]] = {k: [] for k in kinds}
    shares: dict[int, list[float]] = {k: [] for k in EVERY}
    for attempt in range(repeats):
        for every in kinds if attempt % 2 == 0 else kinds[::-1]:
            run = f"shadow-{layout}-{every}-{attempt}"
            runs[every].append(trainer_tokens_per_s(root, store, snapshot, size, run, ranks=2,
                                                    nodes=2, shadow=_shadow(every),
                                                    layout=_layout(layout, 2)))  # fmt: skip
            if every:
                shares[every].append(_checks_share(store, run))
    rows = []
    for every in EVERY:
        rows.append(_row(f"tokens/s, 2 ranks {layout}, {size.label}: shadow_every {every} vs "
                         "none", runs[every], runs[0]))  # fmt: skip
        share = statistics.median(shares[every])
        rows.append((f"{layout}: shadow checks' share of training time, every {every} (ledger)",
                     f"{share:.3%}", "-", f"{1 - share:.4f}"))  # fmt: skip
    return rows


def detection(root: Path, store: LocalStore, snapshot) -> list:
    size = Size(SIZES[0].label, SIZES[0].model, 12, measured_steps=3 * DETECT_EVERY)
    faults = [("ddp", "flip-bit", 7, ""), ("ddp", "flip-bit", 61, ""),
              ("ddp", "flip-bit", 120, ""), ("ddp", "corrupt-grad", 100, "1.02"),
              ("ddp", "corrupt-grad", 101, "1.02"), ("fsdp", "corrupt-grad", 100, "1.02"),
              ("fsdp", "corrupt-grad", 150, "1.5")]  # fmt: skip
    rows = []
    for n, (layout, fault, step, scale) in enumerate(faults):
        run = f"detect-{n}"
        chaos = root / run / "CHAOS"
        chaos.parent.mkdir(parents=True, exist_ok=True)
        chaos.write_text(f"{fault} {step} {scale}".strip() + "\n")
        # A verdict ends the attempt before its last step: no throughput to read, a failure.
        with contextlib.suppress(RanksFailed):
            trainer_tokens_per_s(root, store, snapshot, size, run, ranks=3, nodes=3,
                                 shadow=_shadow(DETECT_EVERY),
                                 layout=_layout(layout, 3))  # fmt: skip
        lines = (root / run / "progress.jsonl").read_text().splitlines()
        named = [e for e in map(json.loads, lines)
                 if e["event"] == "health" and e["kind"] == "corruption"]  # fmt: skip
        fault_text = f"{fault} {scale}".strip()
        what = f"{layout}: {fault_text} at step {step}, checks every {DETECT_EVERY}"
        if named:
            found = named[0]
            rows.append((what, f"rank {found['rank']} named at step {found['step']}", "-",
                         f"{found['step'] - step} steps"))  # fmt: skip
        else:
            rows.append((what, "not named", "-", "-"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1200, help="measured steps a run")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--layouts", default="ddp,fsdp", help="throughput's layouts")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-shadow-") as tmp:
        root = Path(tmp)
        store = LocalStore(root / "store")
        settings = SnapshotSettings(filters=FilterSettings(min_words=1))
        snapshot = prepare_snapshot([str(CORPUS)], settings, store, root / "dataprep")
        rows = []
        for layout in [] if args.skip_throughput else args.layouts.split(","):
            rows += throughput(root, store, snapshot, args.steps, args.repeats, layout)
        rows += detection(root, store, snapshot)
    print(table(rows))


if __name__ == "__main__":
    main()
