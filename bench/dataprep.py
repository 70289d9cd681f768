"""Data-preparation benchmark: our pipeline beside datatrove's MinHash dedup and a bare
`Tokenizer.encode_batch`, on the same ≥ 50,000-document corpus, in one run.

    python -m bench.dataprep [--workers 1 2] [--skip-datatrove] [--out results.json]

Prints four tables: documents/s and peak RSS of every stage; near-dedup throughput, precision
and recall beside datatrove's (same 5-grams, 14 bands × 8 rows) against exact-Jaccard ground
truth; tokenize+shard tokens/s beside bare encode_batch; and the band-index group-by under a
DuckDB memory budget smaller than the index. Filters are off so both systems see the same
documents. Needs the `bench` extra for datatrove: `make bench-dataprep` installs it and runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer

from bench.corpus import BenchDoc, build_corpus, ground_truth_pairs, verified_pairs, write_jsonl
from bench.datatrove_minhash import TreeMemorySampler, run_datatrove_minhash
from bench.metrics import pairs_from_clusters, precision_recall
from dataprep.dataset_manifest import DatasetManifest
from dataprep.dedup_stage import DEDUP
from dataprep.filters import FilterSettings
from dataprep.near_dedup import UnionFind
from dataprep.plan import SnapshotPlan, plan_snapshot
from dataprep.scan import SCAN
from dataprep.settings import DedupSettings, SnapshotSettings, TokenizerSettings
from dataprep.snapshot import commit_snapshot, save_plan
from dataprep.stage_runner import run_stage
from dataprep.tokenize_stage import TOKENIZE, TOKENIZER
from infra.store.local import LocalStore

REPO = Path(__file__).resolve().parent.parent
CORPUS_FILES = 8  # JSONL shards: the unit our chunks and datatrove's tasks split on

NO_FILTERS = FilterSettings(gopher=False, repetition=False, min_chars=0)


@dataclass
class OurRun:
    workers: int
    verify: bool
    stage_seconds: dict[str, float] = field(default_factory=dict)
    stage_rss_mb: dict[str, float] = field(default_factory=dict)
    clusters: dict[int, int] = field(default_factory=dict)
    tokens: int = 0
    kept_texts: Path | None = None  # Parquet: the tokenize stage's exact input, in order
    tokenizer_path: Path | None = None


def _pool_map(workers: int, fn, args: list) -> None:
    """Chunks in parallel on `workers` processes (as data workers would take them)."""
    if workers == 1:
        for arg in args:
            fn(*arg)
        return
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        list(pool.map(_star, [(fn, arg) for arg in args]))


def _quiet(_: str) -> None:
    """Progress goes nowhere (a module function: the pool's processes get it by name)."""


def _star(job: tuple) -> None:
    fn, args = job
    fn(*args)


def run_ours(corpus: Path, workers: int, verify: bool, work: Path, offsets: list[int]) -> OurRun:
    """The whole pipeline; run in a process of its own so its memory is its own."""
    settings = SnapshotSettings(
        filters=NO_FILTERS,
        dedup=DedupSettings(verify=verify, memory_limit="2GB"),
        tokenizer=TokenizerSettings(kind="bpe", vocab_size=8192, train_bytes=20 << 20),
        chunk_bytes=1,  # one chunk per corpus file
    )
    store = LocalStore(work / "store")
    run = OurRun(workers, verify)

    def timed(stage: str, fn, *args):
        with TreeMemorySampler(os.getpid(), interval=0.05) as sampler:
            started = time.perf_counter()
            result = fn(*args)
            run.stage_seconds[stage] = time.perf_counter() - started
        run.stage_rss_mb[stage] = sampler.peak_rss_bytes / 2**20
        return result

    plan = timed("plan", plan_snapshot, [str(corpus)], settings)
    save_plan(store, plan)
    chunks = [c.index for c in plan.chunks]
    quiet = _quiet
    scans = [(SCAN, store, plan, settings, work / f"w{i}", quiet, i) for i in chunks]
    timed("scan", _pool_map, workers, run_stage, scans)
    timed("dedup", run_stage, DEDUP, store, plan, settings, work / "dedup")
    timed("tokenizer", run_stage, TOKENIZER, store, plan, settings, work / "tok")
    tokenizes = [(TOKENIZE, store, plan, settings, work / f"t{i}", quiet, i) for i in chunks]
    timed("tokenize", _pool_map, workers, run_stage, tokenizes)
    run.kept_texts, run.tokenizer_path = _tokenize_input(store, plan, work)
    snapshot = timed("commit", commit_snapshot, store, plan, settings, work / "commit")
    run.tokens = sum(s.tokens for s in snapshot.manifest.splits.values())
    run.clusters = _our_clusters(store, snapshot.manifest, plan, offsets)
    return run


def _tokenize_input(store: LocalStore, plan: SnapshotPlan, work: Path) -> tuple[Path, Path]:
    """Save the tokenize stage's input (kept texts, in order) and tokenizer for the baseline."""
    root = store.root / f"datasets/{plan.snapshot_id}/work"
    files = "[" + ", ".join(f"'{p}'" for p in sorted((root / "scan").glob("docs-*.parquet"))) + "]"
    texts = work / "kept-texts.parquet"
    duckdb.sql(
        f"COPY (SELECT text FROM read_parquet({files}) d "
        f"ANTI JOIN read_parquet('{root / 'dedup' / 'removed.parquet'}') r "
        f"ON d.doc_id = r.doc_id ORDER BY d.doc_id) TO '{texts}' (FORMAT parquet)"
    )
    tokenizer = work / "bare-tokenizer.json"
    tokenizer.write_bytes((root / "tokenizer" / "tokenizer.json").read_bytes())
    return texts, tokenizer


def _our_clusters(
    store: LocalStore, manifest: DatasetManifest, plan: SnapshotPlan, offsets: list[int]
) -> dict[int, int]:
    """bench doc_id -> cluster, from the report's (doc_id, duplicate_of) rows."""
    table = pq.read_table(store.root / manifest.report["documents"].key).to_pydict()
    ours_to_bench = {}
    order = {f.path: i for i, f in enumerate(plan.files)}
    for doc_id, source, position in zip(
        table["doc_id"], table["source"], table["position"], strict=True
    ):
        ours_to_bench[doc_id] = offsets[order[source]] + position - 1  # JSONL lines count from 1
    sets = UnionFind()
    for doc_id, kept in zip(table["doc_id"], table["duplicate_of"], strict=True):
        if kept is not None:
            sets.union(ours_to_bench[doc_id], ours_to_bench[kept])
    return {member: sets.find(member) for member in sets.parent}


def write_corpus(docs: list[BenchDoc], folder: Path) -> list[int]:
    """CORPUS_FILES JSONL files; returns each file's first bench doc_id."""
    folder.mkdir(parents=True, exist_ok=True)
    per_file = -(-len(docs) // CORPUS_FILES)
    for i in range(CORPUS_FILES):
        write_jsonl(docs[i * per_file : (i + 1) * per_file], folder / f"part-{i:02d}.jsonl")
    return [i * per_file for i in range(CORPUS_FILES)]


def bare_encode_batch(texts_file: Path, tokenizer_path: Path) -> tuple[float, int]:
    texts = pq.read_table(texts_file).column("text").to_pylist()
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    started = time.perf_counter()
    tokens = 0
    for start in range(0, len(texts), 1024):
        tokens += sum(len(e.ids) + 1 for e in tokenizer.encode_batch(texts[start : start + 1024]))
    return time.perf_counter() - started, tokens


def memory_budget(work: Path, budgets: list[str]) -> list[dict]:
    """The band-index group-by on 1.43 M documents × 14 bands (20 M rows) under each budget,
    each in its own process so peak RSS is that run's alone."""
    index = work / "big-bands.parquet"
    docs, bands = 1_430_000, 14
    if not index.exists():
        rng = np.random.default_rng(0)
        doc_ids = np.repeat(np.arange(docs, dtype=np.int64), bands)
        band = np.tile(np.arange(bands, dtype=np.int16), docs)
        hashes = rng.integers(-(2**62), 2**62, size=docs * bands, dtype=np.int64)
        copies = np.arange(1000, docs, 1000)
        hashes[copies * bands] = hashes[(copies - 1) * bands]  # plant one shared band each
        pq.write_table(pa.table({"doc_id": doc_ids, "band": band, "hash": hashes}), index)
        pq.write_table(pa.table({"doc_id": pa.array([], pa.int64())}), work / "none.parquet")
    raw_mb = docs * bands * (8 + 2 + 8) / 2**20
    rows = []
    for budget in budgets:
        code = (
            "import sys, time, json; from pathlib import Path;"
            "from dataprep.near_dedup import connect, candidate_pairs;"
            "w = Path(sys.argv[1]); con = connect(sys.argv[2], w / 'spill', 2);"
            "t = time.perf_counter();"
            "index, none = w / 'big-bands.parquet', w / 'none.parquet';"
            "n = candidate_pairs(con, [index], none, w / 'e.parquet');"
            "print(json.dumps({'pairs': n, 'seconds': time.perf_counter() - t}))"
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", code, str(work), budget],
            stdout=subprocess.PIPE,
            cwd=REPO,
            text=True,
        )
        with TreeMemorySampler(proc.pid, interval=0.05) as sampler:
            out, _ = proc.communicate()
        result = json.loads(out.strip().splitlines()[-1])
        rows.append(
            {
                "budget": budget,
                "index_raw_mb": raw_mb,
                **result,
                "peak_rss_mb": sampler.peak_rss_bytes / 2**20,
            }
        )
    return rows


def score(docs: list[BenchDoc], truth: set, clusters: dict[int, int]) -> dict:
    predicted = pairs_from_clusters(clusters)
    precision, recall = precision_recall(predicted, truth)
    planted = {d.doc_id for d in docs if d.cluster is not None}
    truth_planted = {p for p in truth if p[0] in planted}
    verified = verified_pairs(docs, predicted)
    return {
        "precision": precision,
        "recall": recall,
        "recall_planted": precision_recall(predicted, truth_planted)[1],
        "recall_exact": precision_recall(predicted, truth - truth_planted)[1],
        "precision_verified": len(verified) / len(predicted) if predicted else 1.0,
        "pairs": len(predicted),
    }


def table(title: str, header: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(cells[0], widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells[1:]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--skip-datatrove", action="store_true")
    parser.add_argument("--budgets", nargs="+", default=["128MB", "8GB"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="forgeline-bench-") as tmp:
        work = Path(tmp)
        started = time.perf_counter()
        docs = build_corpus()
        truth = ground_truth_pairs(docs)
        corpus = work / "corpus"
        offsets = write_corpus(docs, corpus)
        print(
            f"corpus: {len(docs):,} documents, {len(truth):,} ground-truth pairs ≥ 0.8 "
            f"({time.perf_counter() - started:.1f} s to build)",
            flush=True,
        )

        results: dict = {"docs": len(docs), "runs": []}
        stage_rows, dedup_rows, token_rows = [], [], []
        for workers in args.workers:
            for verify in (False, True):
                with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as solo:
                    run = solo.submit(
                        run_ours,
                        corpus,
                        workers,
                        verify,
                        work / f"ours-{workers}-{verify}",
                        offsets,
                    ).result()
                seconds = run.stage_seconds
                near = seconds["scan"] + seconds["dedup"]
                quality = score(docs, truth, run.clusters)
                results["runs"].append(
                    {
                        "system": "forgeline",
                        "workers": workers,
                        "verify": verify,
                        "stage_seconds": seconds,
                        "stage_rss_mb": run.stage_rss_mb,
                        **quality,
                    }
                )
                if not verify:
                    stage_rows += [
                        [
                            workers,
                            s,
                            f"{t:.2f}",
                            f"{len(docs) / t:,.0f}",
                            f"{run.stage_rss_mb[s]:,.0f}",
                        ]
                        for s, t in seconds.items()
                    ]
                if not verify and workers == 1:
                    # One process on each side: encode_batch already runs on every core, so a
                    # second worker process only adds contention to this stage.
                    bare_s, bare_tokens = bare_encode_batch(run.kept_texts, run.tokenizer_path)
                    ours_rate = run.tokens / seconds["tokenize"]
                    bare_rate = bare_tokens / bare_s
                    token_rows.append(
                        [f"{ours_rate:,.0f}", f"{bare_rate:,.0f}", f"{ours_rate / bare_rate:.2f}"]
                    )
                dedup_rows.append(
                    [
                        "forgeline" + (" +verify" if verify else ""),
                        workers,
                        f"{near:.1f}",
                        f"{len(docs) / near:,.0f}",
                        "",
                        f"{quality['precision']:.3f}",
                        f"{quality['recall']:.3f}",
                        f"{quality['recall_planted']:.3f}",
                        f"{quality['recall_exact']:.3f}",
                        f"{max(run.stage_rss_mb['scan'], run.stage_rss_mb['dedup']):,.0f}",
                    ]
                )
                print(f"forgeline workers={workers} verify={verify}: {seconds}", flush=True)
            if not args.skip_datatrove:
                base = run_datatrove_minhash(docs, work / f"datatrove-{workers}", workers=workers)
                quality = score(docs, truth, base.clusters)
                results["runs"].append(
                    {
                        "system": "datatrove",
                        "workers": workers,
                        "seconds": base.seconds,
                        "peak_rss_mb": base.peak_rss_mb,
                        **quality,
                    }
                )
                dedup_rows.append(
                    [
                        "datatrove",
                        workers,
                        f"{base.seconds:.1f}",
                        f"{len(docs) / base.seconds:,.0f}",
                        "1.00",
                        f"{quality['precision']:.3f}",
                        f"{quality['recall']:.3f}",
                        f"{quality['recall_planted']:.3f}",
                        f"{quality['recall_exact']:.3f}",
                        f"{base.peak_rss_mb:,.0f}",
                    ]
                )
                for row in dedup_rows:
                    if row[1] == workers and row[0].startswith("forgeline"):
                        row[4] = f"{base.seconds / float(row[2]):.1f}"
                print(f"datatrove workers={workers}: {base.seconds:.1f} s", flush=True)
        budget_rows = memory_budget(work, args.budgets)
        results["memory_budget"] = budget_rows

    print()
    print(
        table(
            "stages (forgeline, filters off, bpe 8192)",
            ["workers", "stage", "seconds", "docs/s", "peak RSS MB"],
            stage_rows,
        )
    )
    print()
    print(
        table(
            "near-dedup: read + MinHash + band index + clusters (5-grams, 14 × 8)",
            [
                "system",
                "workers",
                "seconds",
                "docs/s",
                "× datatrove",
                "precision",
                "recall",
                "recall planted",
                "recall exact",
                "peak RSS MB",
            ],
            dedup_rows,
        )
    )
    print()
    print(
        table(
            "tokenize + shard vs bare encode_batch (same texts, same tokenizer)",
            ["ours tokens/s", "encode_batch tokens/s", "ratio"],
            token_rows,
        )
    )
    print()
    print(
        table(
            "band-index group-by (20 M rows) under a DuckDB memory budget",
            ["budget", "index raw MB", "seconds", "peak RSS MB", "candidate pairs"],
            [
                [
                    r["budget"],
                    f"{r['index_raw_mb']:,.0f}",
                    f"{r['seconds']:.1f}",
                    f"{r['peak_rss_mb']:,.0f}",
                    r["pairs"],
                ]
                for r in budget_rows
            ],
        )
    )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
