import random

import numpy as np
import pytest

from dataprep.minhash import BandHasher, MinHashSettings, shingle_hashes
from dataprep.normalize import normalize


def words(rng: random.Random, count: int) -> list[str]:
    return [f"w{rng.randrange(50_000)}" for _ in range(count)]


def exact_jaccard(a: str, b: str, n: int = 5) -> float:
    def shingles(text: str) -> set[str]:
        w = normalize(text).split(" ")
        return {" ".join(w[i : i + n]) for i in range(max(1, len(w) - n + 1))}

    sa, sb = shingles(a), shingles(b)
    return len(sa & sb) / len(sa | sb)


def test_a_shingle_hashes_the_same_wherever_it_stands() -> None:
    a = shingle_hashes("x y a b c d e z", 5)
    b = shingle_hashes("q a b c d e", 5)
    assert len(a) == 4 and len(b) == 2
    assert a[2] == b[1]  # "a b c d e"
    assert len(set(a.tolist())) == 4
    # Shorter than n words: one shingle of everything; empty: none.
    assert shingle_hashes("one two", 5).tolist() == shingle_hashes("one two", 5).tolist()
    assert len(shingle_hashes("one two", 5)) == 1
    assert len(shingle_hashes("", 5)) == 0


def test_shingle_hashes_match_distinct_shingles() -> None:
    rng = random.Random(1)
    for _ in range(50):
        text = " ".join(rng.choice(["a", "b", "c", "dd"]) for _ in range(rng.randint(1, 60)))
        w = text.split(" ")
        distinct = {" ".join(w[i : i + 3]) for i in range(max(1, len(w) - 2))}
        # 32-bit hashes of a few dozen shingles: a collision here would be a bug, not chance.
        assert len(set(shingle_hashes(text, 3).tolist())) == len(distinct)


def test_signature_estimates_jaccard() -> None:
    rng = random.Random(2)
    hasher = BandHasher(MinHashSettings(bands=32, rows=8))
    base = words(rng, 300)
    for edits in (3, 10, 30, 80):
        copy = list(base)
        for i in rng.sample(range(len(copy)), edits):
            copy[i] = f"edit{i}"
        a, b = " ".join(base), " ".join(copy)
        estimate = float(np.mean(hasher.signature(a).copy() == hasher.signature(b)))
        assert estimate == pytest.approx(exact_jaccard(a, b), abs=0.08), edits


def test_bands_are_equal_exactly_when_their_rows_are() -> None:
    settings = MinHashSettings()
    hasher = BandHasher(settings)
    rng = random.Random(3)
    text = " ".join(words(rng, 200))
    assert hasher.bands(text).tolist() == BandHasher(settings).bands(text).tolist()
    assert hasher.bands(text).dtype == np.int64 and len(hasher.bands(text)) == 14
    rows = hasher.signature(text).copy().reshape(14, 8)
    other = " ".join(words(rng, 200))
    other_rows = hasher.signature(other).reshape(14, 8)
    same_rows = [bool(np.array_equal(r, o)) for r, o in zip(rows, other_rows, strict=True)]
    same_bands = (hasher.bands(text) == hasher.bands(other)).tolist()
    assert same_bands == same_rows


def test_settings_are_checked() -> None:
    assert MinHashSettings().num_perm == 112
    assert MinHashSettings().threshold == pytest.approx((1 / 14) ** (1 / 8))
    with pytest.raises(ValueError, match=r"dedup\.bands"):
        MinHashSettings(bands=0)
