"""Fast checks of the benchmark building blocks (not in the default suite: it lives in bench/).

Run with ``.venv/bin/pytest bench/test_bench_building_blocks.py -q``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bench.corpus import (
    BenchDoc,
    build_corpus,
    ground_truth_pairs,
    jaccard,
    shingles,
    verified_pairs,
    write_jsonl,
)
from bench.metrics import pairs_from_clusters, precision_recall


def _words(rng: random.Random, k: int) -> list[str]:
    # Letters only: datatrove maps digits to "0" and drops punctuation, which would merge words.
    return ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=7)) for _ in range(k)]


def test_shingles_normalize_and_split() -> None:
    assert shingles("A  B\tc\nD e f", n=5) == {"a b c d e", "b c d e f"}
    # NFKC folds the ligature, casefold folds ß to ss.
    assert shingles("ﬁne STRASSE", n=2) == shingles("fine straße", n=2) == {"fine strasse"}
    # Fewer than n words: one shingle of all of them; blank text still has one.
    assert shingles("  Hello   World ", n=5) == {"hello world"}
    assert shingles("", n=5) == {""}


def test_jaccard() -> None:
    assert jaccard("a b c d e f", "A B C D E F") == 1.0
    # 2 shingles vs 2, sharing 1: 1/3.
    assert jaccard("a b c d e f", "a b c d e g") == pytest.approx(1 / 3)
    assert jaccard("a b c d e", "v w x y z") == 0.0


@pytest.fixture(scope="module")
def small_corpus() -> list[BenchDoc]:
    return build_corpus(seed=3, synthetic=300, clusters=20)


def test_corpus_is_reproducible(small_corpus: list[BenchDoc], tmp_path: Path) -> None:
    write_jsonl(small_corpus, tmp_path / "a.jsonl")
    write_jsonl(build_corpus(seed=3, synthetic=300, clusters=20), tmp_path / "b.jsonl")
    write_jsonl(build_corpus(seed=4, synthetic=300, clusters=20), tmp_path / "c.jsonl")
    a = (tmp_path / "a.jsonl").read_bytes()
    assert a == (tmp_path / "b.jsonl").read_bytes()
    assert a != (tmp_path / "c.jsonl").read_bytes()

    lines = a.decode("utf-8").splitlines()
    assert len(lines) == len(small_corpus)
    first = json.loads(lines[0])
    assert set(first) == {"id", "text", "origin"}
    assert [json.loads(line)["id"] for line in lines] == list(range(len(small_corpus)))


def test_corpus_composition(small_corpus: list[BenchDoc]) -> None:
    assert [d.doc_id for d in small_corpus] == list(range(len(small_corpus)))
    origins = {d.origin for d in small_corpus}
    assert origins == {"shakespeare", "stdlib", "synthetic", "planted"}
    assert sum(d.origin == "synthetic" for d in small_corpus) == 300
    assert sum(d.origin == "shakespeare" for d in small_corpus) > 5_000
    assert sum(d.origin == "stdlib" for d in small_corpus) > 300
    assert all(d.text.strip() for d in small_corpus)

    clusters: dict[int, list[BenchDoc]] = {}
    for d in small_corpus:
        assert (d.cluster is not None) == (d.origin == "planted")
        if d.cluster is not None:
            clusters.setdefault(d.cluster, []).append(d)
    assert sorted(clusters) == list(range(20))
    for members in clusters.values():
        bases = [d for d in members if d.base_jaccard == 1.0]
        assert len(bases) == 1 and 2 <= len(members) <= 5
        for copy in members:
            if copy is not bases[0]:
                # The stored value is the exact Jaccard, and copies are never exact copies.
                assert copy.base_jaccard == jaccard(copy.text, bases[0].text)
                assert 0.4 < copy.base_jaccard < 1.0


def test_ground_truth_planted_and_exact(small_corpus: list[BenchDoc]) -> None:
    truth = ground_truth_pairs(small_corpus, threshold=0.8)
    by_id = {d.doc_id: d for d in small_corpus}
    assert truth and all(a < b for a, b in truth)
    for a, b in truth:
        assert jaccard(by_id[a].text, by_id[b].text) >= 0.8
    planted = {(a, b) for a, b in truth if by_id[a].cluster is not None}
    # Every base-copy pair at or above the threshold is in.
    for d in small_corpus:
        if d.base_jaccard is not None and 0.8 <= d.base_jaccard < 1.0:
            base = next(
                x.doc_id for x in small_corpus if x.cluster == d.cluster and x.base_jaccard == 1.0
            )
            assert tuple(sorted((d.doc_id, base))) in planted
    # Lowering the threshold can only add pairs.
    assert truth <= ground_truth_pairs(small_corpus, threshold=0.5)


def test_ground_truth_exact_duplicates_and_verification() -> None:
    rng = random.Random(0)
    base = " ".join(_words(rng, 40))
    docs = [
        BenchDoc(0, base, "synthetic", None),
        BenchDoc(1, " ".join(_words(rng, 40)), "synthetic", None),
        BenchDoc(2, "  " + base.upper().replace(" ", "\n") + " ", "synthetic", None),
        BenchDoc(3, base, "stdlib", None),
    ]
    truth = ground_truth_pairs(docs)
    assert truth == {(0, 2), (0, 3), (2, 3)}
    reported = {(3, 0), (0, 1), (1, 2)}
    assert verified_pairs(docs, reported, threshold=0.8) == {(0, 3)}


def test_metrics() -> None:
    assert pairs_from_clusters({5: 0, 1: 0, 9: 0, 4: 7, 2: 7, 8: 3}) == {
        (1, 5),
        (1, 9),
        (5, 9),
        (2, 4),
    }
    assert pairs_from_clusters({}) == set()
    assert precision_recall({(1, 2), (3, 4)}, {(1, 2), (5, 6), (7, 8)}) == (0.5, 1 / 3)
    assert precision_recall(set(), {(1, 2)}) == (1.0, 0.0)
    assert precision_recall({(1, 2)}, set()) == (0.0, 1.0)
    assert precision_recall(set(), set()) == (1.0, 1.0)


def _tiny_docs() -> list[BenchDoc]:
    rng = random.Random(7)
    texts = [" ".join(_words(rng, 60)) for _ in range(10)]
    texts[7] = texts[1]  # exact duplicate, in the other input shard when workers=2
    near = texts[3].split(" ")
    near[30] = "zzzzzzz"  # one substitution: Jaccard 51/61 ≈ 0.84
    texts[8] = " ".join(near)
    texts[4] = texts[9] = "too short to shingle"  # exact duplicates of under 5 words
    return [BenchDoc(i, t, "synthetic", None) for i, t in enumerate(texts)]


@pytest.mark.parametrize("workers", [1, 2])
def test_datatrove_maps_clusters_to_doc_ids(workers: int, tmp_path: Path) -> None:
    pytest.importorskip("datatrove")
    from bench.datatrove_minhash import run_datatrove_minhash

    docs = _tiny_docs()
    assert jaccard(docs[3].text, docs[8].text) == pytest.approx(51 / 61)
    result = run_datatrove_minhash(docs, tmp_path, workers=workers)

    assert pairs_from_clusters(result.clusters) == {(1, 7), (3, 8)}
    # Datatrove keeps the first document of a cluster and removes the rest.
    assert result.removed == {7, 8}
    # Its shingles come from its own tokenizer; a document under 5 tokens gets no signature,
    # so these exact duplicates are never reported.
    assert 4 not in result.clusters and 9 not in result.clusters
    assert result.seconds > 0 and result.peak_rss_mb > 0
    assert result.params["hash_fc"] == "xxhash" and result.params["hash_precision"] == 64
