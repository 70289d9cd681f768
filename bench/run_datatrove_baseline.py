"""Run datatrove's MinHash dedup on the benchmark corpus and score it against exact Jaccard.

``python -m bench.run_datatrove_baseline [--workers 1 2] [--workdir DIR] [--out results.json]``
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.corpus import BenchDoc, build_corpus, ground_truth_pairs, verified_pairs
from bench.datatrove_minhash import BaselineResult, run_datatrove_minhash
from bench.metrics import pairs_from_clusters, precision_recall


def score(
    docs: list[BenchDoc],
    truth: set[tuple[int, int]],
    result: BaselineResult,
    threshold: float = 0.8,
) -> dict[str, Any]:
    predicted = pairs_from_clusters(result.clusters)
    precision, recall = precision_recall(predicted, truth)
    verified = verified_pairs(docs, predicted, threshold)
    planted = {d.doc_id for d in docs if d.cluster is not None}
    truth_planted = {p for p in truth if p[0] in planted}
    truth_exact = truth - truth_planted
    return {
        "docs": len(docs),
        "seconds": round(result.seconds, 2),
        "docs_per_s": round(len(docs) / result.seconds),
        "stage_seconds": {k: round(v, 2) for k, v in result.stage_seconds.items()},
        "peak_rss_mb": round(result.peak_rss_mb),
        "peak_pss_mb": round(result.params["tree_peak_pss_mb"]),
        "clusters": len(set(result.clusters.values())),
        "clustered_docs": len(result.clusters),
        "removed": len(result.removed),
        "predicted_pairs": len(predicted),
        "truth_pairs": len(truth),
        "precision_vs_truth": round(precision, 4),
        "recall_vs_truth": round(recall, 4),
        "precision_vs_verified": round(len(verified) / len(predicted), 4) if predicted else 1.0,
        "recall_planted": round(precision_recall(predicted, truth_planted)[1], 4),
        "recall_exact_dups": round(precision_recall(predicted, truth_exact)[1], 4),
        "verified_outside_truth": len(verified - truth),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    docs = build_corpus(args.seed)
    truth = ground_truth_pairs(docs)
    elapsed = time.perf_counter() - t0
    print(f"corpus: {len(docs):,} docs, {len(truth):,} truth pairs ({elapsed:.1f} s)")

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="forgeline-bench-"))
    results: dict[str, Any] = {}
    for workers in args.workers:
        result = run_datatrove_minhash(docs, workdir / f"workers{workers}", workers=workers)
        results[f"workers={workers}"] = score(docs, truth, result)
        results["datatrove_params"] = {
            k: v for k, v in result.params.items() if not k.endswith("_mb") and k != "workers"
        }
        print(f"workers={workers}: {json.dumps(results[f'workers={workers}'], indent=2)}")
    print(f"datatrove: {json.dumps(results['datatrove_params'])}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
