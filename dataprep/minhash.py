"""MinHash band signatures for near-duplicate detection, with datasketch doing the permutations.

Shingles are word n-grams of the normalized text (`dataprep.normalize.normalize`, the same as exact
dedup; callers normalize once for both). Their
hashes are computed for a whole document at once with a polynomial hash over the UTF-8 bytes:
with prefix sums P[i] = Σ_{j<i} byte_j·B^j (mod 2^64), the hash of bytes [s, e) is
(P[e] − P[s])·B^−s, so every n-gram's hash costs a few vectorised numpy operations instead of a
Python join + SHA-1 per shingle, which is where per-document MinHash time usually goes.
datasketch then applies its permutations (scheme affine32) to those hashes; the signature's
bands × rows values are folded into one 64-bit hash per band, the key of the LSH band index.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from datasketch import MinHash

_U64 = np.uint64
_BASE = 0x100000001B3  # odd, so it has an inverse modulo 2^64
_BASE_INV = pow(_BASE, -1, 1 << 64)
# Odd multipliers that fold a band's rows into one value (one per row, fixed forever).
_ROW_KEYS = np.array(
    [(0x9E3779B97F4A7C15 + 2 * k * 0x632BE59BD9B4E019 | 1) % (1 << 64) for k in range(64)],
    dtype=_U64,
)


@dataclass(frozen=True)
class MinHashSettings:
    ngram: int = 5
    bands: int = 14
    rows: int = 8
    seed: int = 1

    def __post_init__(self) -> None:
        for name in ("ngram", "bands", "rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"dedup.{name} must be at least 1")
        if self.rows > len(_ROW_KEYS):
            raise ValueError(f"dedup.rows must be at most {len(_ROW_KEYS)}")

    @property
    def num_perm(self) -> int:
        return self.bands * self.rows

    @property
    def threshold(self) -> float:
        """The similarity at which a pair becomes a candidate with probability ~1/2."""
        return (1.0 / self.bands) ** (1.0 / self.rows)


def _fmix64(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's finalizer: avalanches the polynomial hash's weak low bits."""
    h = h ^ (h >> _U64(33))
    h = h * _U64(0xFF51AFD7ED558CCD)
    h = h ^ (h >> _U64(33))
    h = h * _U64(0xC4CEB9FE1A85EC53)
    return h ^ (h >> _U64(33))


class _Powers:
    """B^i and B^-i mod 2^64 for i < n, grown on demand (numpy's uint64 products wrap)."""

    def __init__(self) -> None:
        self.up = np.ones(1, dtype=_U64)
        self.down = np.ones(1, dtype=_U64)

    def ensure(self, n: int) -> None:
        if len(self.up) >= n:
            return
        size = max(n, 2 * len(self.up))
        self.up = np.cumprod(np.r_[1, np.full(size - 1, _BASE, dtype=_U64)].astype(_U64))
        self.down = np.cumprod(np.r_[1, np.full(size - 1, _BASE_INV, dtype=_U64)].astype(_U64))


def shingle_hashes(normalized: str, ngram: int, powers: _Powers | None = None) -> np.ndarray:
    """32-bit hashes of a normalized document's word n-grams (one per position; repeats kept).

    A document shorter than `ngram` words has one shingle: all of its words.
    """
    data = np.frombuffer(normalized.encode(), dtype=np.uint8)
    if len(data) == 0:
        return np.empty(0, dtype=np.uint32)
    powers = powers or _Powers()
    powers.ensure(len(data) + 1)
    spaces = np.flatnonzero(data == 32)
    starts = np.concatenate([[0], spaces + 1])
    ends = np.concatenate([spaces, [len(data)]])
    count = max(1, len(starts) - ngram + 1)
    first, last = starts[:count], ends[min(ngram, len(starts)) - 1 :][:count]
    with np.errstate(over="ignore"):
        prefix = np.concatenate([[_U64(0)], np.cumsum(data.astype(_U64) * powers.up[: len(data)])])
        h = (prefix[last] - prefix[first]) * powers.down[first]
        h = _fmix64(h ^ (last - first).astype(_U64))
    return (h >> _U64(32)).astype(np.uint32)


class BandHasher:
    """Band hashes of documents, reusing one datasketch MinHash (creating one costs ~0.2 ms)."""

    def __init__(self, settings: MinHashSettings) -> None:
        self.settings = settings
        self._powers = _Powers()
        # The shingle hashes are already uniform 32-bit values: datasketch only permutes them.
        self._minhash = MinHash(
            num_perm=settings.num_perm, seed=settings.seed, hashfunc=_identity, scheme="affine32"
        )

    def signature(self, normalized: str) -> np.ndarray:
        """The MinHash signature of a normalized text: num_perm uint32 values."""
        self._minhash.clear()
        hashes = shingle_hashes(normalized, self.settings.ngram, self._powers)
        if len(hashes):
            self._minhash.update_batch(hashes)
        return self._minhash.hashvalues

    def bands(self, normalized: str) -> np.ndarray:
        """One 64-bit hash per band (as int64, DuckDB's BIGINT); equal bands ⇒ equal hashes."""
        shape = (self.settings.bands, self.settings.rows)
        rows = self.signature(normalized).astype(_U64).reshape(shape)
        with np.errstate(over="ignore"):
            folded = (rows * _ROW_KEYS[: self.settings.rows]).sum(axis=1, dtype=_U64)
            folded = _fmix64(folded ^ np.arange(self.settings.bands, dtype=_U64))
        return folded.view(np.int64)


def _identity(value: np.uint32) -> np.uint32:
    return value
