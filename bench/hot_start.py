"""A fine-tune's start where its base model is, against where it must be fetched first.

    python -m bench.hot_start [--repeats 2] [--n-layer 8] [--n-embd 768]

Starts a private stack (Temporal dev server, MLflow, control worker, 1 + repeats node agents of
one rank slot), trains a base model of the given size on one node (2 steps, its checkpoint at
the end: the weights with AdamW's two moments) and registers it, then fine-tunes it from the
registry (`init_from = "models:/bench-base@candidate"`, one node, one step), in pairs:

    fetches   on a node that has never held the base: the others are cordoned, so the scheduler
              can only put it there, and the node copies the base model from the store
    holds     the same fine-tune again with every node open: placement picks the node that now
              holds the base (bytes to fetch), which finds it in its cache

For each: granted → rank 0's process started (the activity reaching the agent and the fetch
into the node cache: the part a held base model saves), granted → the first step, the node it
ran on, and whether the node's cache fetched the base (its index's `fetched_at`). The base
model's checkpoint size is printed with the table.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

from bench.recovery import LocalStack, first_step_at, spec_file, start_split, wait_for
from workflows.contracts.models import Phase

BASE = "bench-base"


def _spec(folder: Path, name: str, steps: int, model: dict[str, int], init_from: bool) -> str:
    path = Path(spec_file(folder, name, steps, steps, 60, 0, {}))
    text = path.read_text()
    for key, value in {**model, "eval_batches": 1}.items():
        text = re.sub(rf"^{key} = .*$", f"{key} = {value}", text, flags=re.M)
    if init_from:
        text = text.replace("[model]\n", f'[model]\ninit_from = "models:/{BASE}@candidate"\n')
    text = text.replace("nodes = 2", "nodes = 1")
    path.write_text(text)
    return str(path)


def _to_approval(stack: LocalStack, spec: str) -> None:
    stack.cli("run", spec, "--detach")
    name = Path(spec).stem
    wait_for(
        lambda: stack.status(name).phase in (Phase.AWAITING_APPROVAL, Phase.FAILED), 1800, name
    )
    status = stack.status(name)
    if status.phase != Phase.AWAITING_APPROVAL:
        raise RuntimeError(f"{name}: {status.phase.value}: {status.error}")


def _base_entry(stack: LocalStack, node: str) -> dict | None:
    index = stack.home / "nodes" / node / "cache" / "index.json"
    if not index.exists():
        return None
    entries = json.loads(index.read_text())["entries"]
    return next((e for rel, e in entries.items() if rel.startswith(f"checkpoints/runs/{BASE}/")),
                None)  # fmt: skip


def _measure(stack: LocalStack, run: str, started: float) -> dict[str, object]:
    status = stack.status(run)
    (attempt,) = status.gang_attempts
    (node,) = [p.parents[1].name for p in (stack.home / "nodes").glob(f"*/runs/{run}")]
    entry = _base_entry(stack, node)
    fetched = entry is not None and entry["fetched_at"] >= started
    return {
        "node": node,
        "to spawn": start_split(attempt)["  to spawn"],
        "to first step": first_step_at(stack, run, attempt.generation)
        - attempt.granted_at.timestamp(),
        "fetched base": fetched,
        "base bytes": entry["bytes"] if entry else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=768)
    args = parser.parse_args()
    model = {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_embd // 64}
    nodes = [f"node-{i}" for i in range(1 + args.repeats)]
    rows: list[tuple[str, dict[str, object]]] = []
    with tempfile.TemporaryDirectory(prefix="forgeline-hot-start-") as tmp:
        folder = Path(tmp)
        stack = LocalStack(folder / "home", {})
        stack.up(len(nodes))
        try:
            _cordon_all_but(stack, nodes, nodes[0])
            _to_approval(stack, _spec(folder, BASE, 2, model, init_from=False))
            for round_, fresh in enumerate(nodes[1:]):
                _cordon_all_but(stack, nodes, fresh)
                started = time.time()
                run = f"bench-ft-fetch-{round_}"
                _to_approval(stack, _spec(folder, run, 1, model, init_from=True))
                rows.append(("fetches", _measure(stack, run, started)))
                _cordon_all_but(stack, nodes, None)  # every node open: placement chooses
                started = time.time()
                run = f"bench-ft-hot-{round_}"
                _to_approval(stack, _spec(folder, run, 1, model, init_from=True))
                rows.append(("holds", _measure(stack, run, started)))
        finally:
            stack.cli("down")
    _print(rows)


def _cordon_all_but(stack: LocalStack, nodes: list[str], open_node: str | None) -> None:
    """Only `open_node` takes work (None: every node does)."""
    for node in nodes:
        stack.cli("node", "undrain" if open_node in (None, node) else "cordon", node)


def _print(rows: list[tuple[str, dict[str, object]]]) -> None:
    size = max(int(r["base bytes"]) for _, r in rows)
    print(f"\nbase model checkpoint: {size / 1e6:,.0f} MB (weights and AdamW moments)\n")
    print(f"{'fine-tune':<10} {'node':<8} {'fetched base':>12} {'granted→spawn s':>16} "
          f"{'granted→step 1 s':>17}")  # fmt: skip
    print("-" * 67)
    for kind, r in rows:
        print(f"{kind:<10} {r['node']:<8} {'yes' if r['fetched base'] else 'no':>12} "
              f"{r['to spawn']:>16.2f} {r['to first step']:>17.2f}")  # fmt: skip
    fetch = [float(r["to spawn"]) for k, r in rows if k == "fetches"]
    hot = [float(r["to spawn"]) for k, r in rows if k == "holds"]
    print("-" * 67)
    fetched, held = statistics.median(fetch), statistics.median(hot)
    print(f"median granted→spawn: fetches {fetched:.2f} s, holds {held:.2f} s: "
          f"{fetched / held:.1f}× as long when the base must be fetched")  # fmt: skip


if __name__ == "__main__":
    main()
