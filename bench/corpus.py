"""A reproducible near-duplicate benchmark corpus with planted clusters and exact ground truth.

Sources, in the order they are drawn (then shuffled together, so planted copies end up in
different input shards):

- ``shakespeare``: the speeches of ``examples/data/tinyshakespeare.txt`` (split on blank lines);
- ``stdlib``: every utf-8 ``.py`` file of the running interpreter's standard library, without
  ``test``/``tests`` folders and ``site-packages`` (so the corpus is byte-identical for one seed
  on one Python install, not across Python versions);
- ``synthetic``: 100–400 words drawn Zipf-like from the Shakespeare vocabulary;
- ``planted``: ``clusters`` synthetic bases of ~200 words, each with 1–4 near-copies edited
  (substitutions/insertions/deletions) towards a target Jaccard drawn from 0.5–0.98.

Ground truth is "planted + exact duplicates": all pairs within planted clusters and all pairs of
documents with equal normalized text, kept where the exact shingle Jaccard reaches the
threshold. Natural near-duplicates elsewhere (stdlib files sharing headers, repeated speech
fragments) are not enumerated; :func:`verified_pairs` checks what a system reports instead.

Run ``python -m bench.corpus`` for a summary.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import string
import sysconfig
import time
import unicodedata
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SHAKESPEARE = REPO_ROOT / "examples" / "data" / "tinyshakespeare.txt"

_WHITESPACE = re.compile(r"\s+")
_SKIP_DIRS = frozenset({"test", "tests", "site-packages", "__pycache__"})
_ZIPF_EXPONENT = 1.0


@dataclass(frozen=True)
class BenchDoc:
    doc_id: int  # 0..N-1, the order documents are written in
    text: str
    origin: str  # "shakespeare" | "stdlib" | "synthetic" | "planted"
    cluster: int | None  # planted cluster id for a base and its near-copies, else None
    # Exact Jaccard against the cluster's base: 1.0 for the base, the measured value for a
    # copy, None outside planted clusters. An addition to the brief's four fields.
    base_jaccard: float | None = None


# ---------------------------------------------------------------------------------------------
# The shared shingle definition (must match the in-house MinHash dedup)


def normalize(text: str) -> str:
    """NFKC + casefold, whitespace runs collapsed to one space, stripped."""
    return _WHITESPACE.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def _word_shingles(words: list[str], n: int) -> set[str]:
    if len(words) < n:
        # A short document still has one shingle, so it can match its exact copies.
        return {" ".join(words)}
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


def shingles(text: str, n: int = 5) -> set[str]:
    """The set of word ``n``-grams of the normalized text."""
    return _word_shingles(normalize(text).split(" "), n)


def _set_jaccard(a: set[str], b: set[str]) -> float:
    if not a and not b:
        return 1.0
    inter = len(a & b)
    return inter / (len(a) + len(b) - inter)


def jaccard(a: str, b: str, n: int = 5) -> float:
    """Exact Jaccard similarity of the two documents' shingle sets."""
    return _set_jaccard(shingles(a, n), shingles(b, n))


# ---------------------------------------------------------------------------------------------
# Sources


def _shakespeare_speeches(path: Path = SHAKESPEARE) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return [s.strip() for s in text.split("\n\n") if s.strip()]


def _stdlib_files() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place and sort, so the walk order (and the corpus) is reproducible.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                text = (Path(dirpath) / name).read_bytes().decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            # Empty files carry no content and datatrove's reader drops documents without text.
            if text.strip():
                texts.append(text)
    return texts


def _vocabulary(speeches: Iterable[str]) -> tuple[list[str], list[float]]:
    """Plain ascii alphabetic Shakespeare words by frequency, with Zipf cumulative weights.

    Punctuation, digits and apostrophes are left out so that every tokenizer (ours, datatrove's
    punctuation-stripping one) sees the same words in synthetic text.
    """
    counts: Counter[str] = Counter()
    for speech in speeches:
        for token in speech.split():
            word = token.strip(string.punctuation).lower()
            if word.isascii() and word.isalpha():
                counts[word] += 1
    vocab = sorted(counts, key=lambda w: (-counts[w], w))
    weights = (1.0 / (rank + 1) ** _ZIPF_EXPONENT for rank in range(len(vocab)))
    cum = list(itertools.accumulate(weights))
    return vocab, cum


class _WordSampler:
    def __init__(self, rng: random.Random, vocab: list[str], cum: list[float]) -> None:
        self.rng, self.vocab, self.cum = rng, vocab, cum

    def words(self, k: int) -> list[str]:
        return self.rng.choices(self.vocab, cum_weights=self.cum, k=k)


def _near_copy(
    base: list[str], base_shingles: set[str], target: float, sampler: _WordSampler, n: int
) -> tuple[list[str], float]:
    """Edit ``base`` one random word at a time until its Jaccard drops to about ``target``.

    Stops at the first edit that reaches the target and keeps whichever of the last two states
    is closer, but never the unedited text: a near-copy is never an exact copy.
    """
    rng = sampler.rng
    words = list(base)
    current = 1.0
    for _ in range(1000):
        candidate = list(words)
        op = rng.random()
        pos = rng.randrange(len(candidate))
        if op < 0.6:
            candidate[pos] = sampler.words(1)[0]
        elif op < 0.8 or len(candidate) <= n + 1:
            candidate.insert(pos, sampler.words(1)[0])
        else:
            del candidate[pos]
        score = _set_jaccard(base_shingles, _word_shingles(candidate, n))
        if score <= target:
            # The previous state only counts if it already differs (an edit can be a no-op).
            if current < 1.0 and current - target < target - score:
                return words, current
            return candidate, score
        words, current = candidate, score
    return words, current


def build_corpus(seed: int = 0, synthetic: int = 45_000, clusters: int = 1_000) -> list[BenchDoc]:
    """Build the benchmark corpus; the same seed gives the same documents in the same order."""
    rng = random.Random(seed)
    n = 5  # the benchmark's shingle size; planted Jaccards are measured with it
    speeches = _shakespeare_speeches()
    sampler = _WordSampler(rng, *_vocabulary(speeches))

    # (text, origin, cluster, base_jaccard) before the shuffle that assigns doc ids
    rows: list[tuple[str, str, int | None, float | None]] = []
    rows += [(s, "shakespeare", None, None) for s in speeches]
    rows += [(t, "stdlib", None, None) for t in _stdlib_files()]
    for _ in range(synthetic):
        rows.append((" ".join(sampler.words(rng.randint(100, 400))), "synthetic", None, None))
    for cluster in range(clusters):
        base = sampler.words(rng.randint(180, 220))
        base_shingles = _word_shingles(base, n)
        rows.append((" ".join(base), "planted", cluster, 1.0))
        for _ in range(rng.randint(1, 4)):
            copy, score = _near_copy(base, base_shingles, rng.uniform(0.5, 0.98), sampler, n)
            rows.append((" ".join(copy), "planted", cluster, score))

    # Shuffle so clusters straddle input shards and origins interleave.
    rng.shuffle(rows)
    return [
        BenchDoc(doc_id=i, text=text, origin=origin, cluster=cluster, base_jaccard=score)
        for i, (text, origin, cluster, score) in enumerate(rows)
    ]


def write_jsonl(docs: list[BenchDoc], path: Path) -> None:
    """One ``{"id", "text", "origin"}`` object per line, utf-8, in the given order."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for doc in docs:
            record = {"id": doc.doc_id, "text": doc.text, "origin": doc.origin}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------------------------------------
# Ground truth


def _pair(a: int, b: int) -> tuple[int, int]:
    return (a, b) if a < b else (b, a)


def ground_truth_pairs(
    docs: list[BenchDoc], threshold: float = 0.8, n: int = 5
) -> set[tuple[int, int]]:
    """Planted + exact duplicates: pairs (a < b) with exact Jaccard >= ``threshold``.

    Candidates are all pairs within each planted cluster (base and copies) and all pairs of
    documents whose normalized text is equal. Other near-duplicates are not enumerated (that
    would be all-pairs); use :func:`verified_pairs` on what a system reports.
    """
    truth: set[tuple[int, int]] = set()

    by_cluster: dict[int, list[BenchDoc]] = defaultdict(list)
    for doc in docs:
        if doc.cluster is not None:
            by_cluster[doc.cluster].append(doc)
    for members in by_cluster.values():
        sets = {d.doc_id: shingles(d.text, n) for d in members}
        for a, b in itertools.combinations(sorted(sets), 2):
            if _set_jaccard(sets[a], sets[b]) >= threshold:
                truth.add((a, b))

    by_text: dict[str, list[int]] = defaultdict(list)
    for doc in docs:
        by_text[normalize(doc.text)].append(doc.doc_id)
    for ids in by_text.values():
        # Equal normalized text means equal shingle sets: Jaccard 1.0, above any threshold.
        truth.update(itertools.combinations(sorted(ids), 2))
    return truth


def verified_pairs(
    docs: list[BenchDoc], pairs: Iterable[tuple[int, int]], threshold: float = 0.8, n: int = 5
) -> set[tuple[int, int]]:
    """The reported pairs whose exact Jaccard is >= ``threshold`` (normalized to a < b)."""
    by_id = {d.doc_id: d for d in docs}
    cache: dict[int, set[str]] = {}

    def sh(doc_id: int) -> set[str]:
        if doc_id not in cache:
            cache[doc_id] = shingles(by_id[doc_id].text, n)
        return cache[doc_id]

    return {_pair(a, b) for a, b in pairs if a != b and _set_jaccard(sh(a), sh(b)) >= threshold}


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--synthetic", type=int, default=45_000)
    parser.add_argument("--clusters", type=int, default=1_000)
    parser.add_argument("--out", type=Path, help="also write the corpus as JSONL here")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    docs = build_corpus(args.seed, args.synthetic, args.clusters)
    built = time.perf_counter() - start
    truth = ground_truth_pairs(docs)
    truth_s = time.perf_counter() - start - built

    by_origin = Counter(d.origin for d in docs)
    planted_ids = {d.doc_id for d in docs if d.cluster is not None}
    planted_pairs = {p for p in truth if p[0] in planted_ids and p[1] in planted_ids}
    copies = [d.base_jaccard for d in docs if d.base_jaccard is not None and d.base_jaccard < 1]
    print(f"documents: {len(docs):,} (seed {args.seed})")
    for origin in ("shakespeare", "stdlib", "synthetic", "planted"):
        print(f"  {origin:<12} {by_origin[origin]:>7,}")
    print(f"planted clusters: {args.clusters:,}, near-copies: {len(copies):,}")
    if copies:
        print(f"  copy-to-base Jaccard: min {min(copies):.3f}, max {max(copies):.3f}")
    print(f"ground truth pairs >= 0.8: {len(truth):,}")
    print(f"  planted:          {len(planted_pairs):,}")
    print(f"  exact duplicates: {len(truth - planted_pairs):,}")
    print(f"built in {built:.1f} s, ground truth in {truth_s:.1f} s")
    if args.out:
        write_jsonl(docs, args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
