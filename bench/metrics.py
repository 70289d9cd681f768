"""Pair-level precision and recall for near-duplicate detection."""

from __future__ import annotations

import itertools
from collections import defaultdict


def pairs_from_clusters(clusters: dict[int, int]) -> set[tuple[int, int]]:
    """All unordered pairs (a < b) of documents that share a cluster id.

    Transitive: a cluster {a, b, c} found through a-b and b-c also yields a-c, which is what a
    cluster-based dedup claims (and removes) even when a and c are not similar themselves.
    """
    members: dict[int, list[int]] = defaultdict(list)
    for doc_id, cluster in clusters.items():
        members[cluster].append(doc_id)
    pairs: set[tuple[int, int]] = set()
    for ids in members.values():
        pairs.update(itertools.combinations(sorted(ids), 2))
    return pairs


def precision_recall(
    predicted: set[tuple[int, int]], truth: set[tuple[int, int]]
) -> tuple[float, float]:
    """(precision over predicted pairs, recall over truth pairs); pairs must be (a < b).

    Empty cases: no predictions means no false positives, so precision is 1.0; no truth pairs
    means nothing to miss, so recall is 1.0.
    """
    hits = len(predicted & truth)
    precision = hits / len(predicted) if predicted else 1.0
    recall = hits / len(truth) if truth else 1.0
    return precision, recall
