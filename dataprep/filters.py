"""Quality filters: each is one predicate over a document that says which rule failed and why.

The rules are Gopher's (Rae et al. 2021, "Scaling Language Models", appendix A): length bounds
for every document; the quality heuristics and the repetition rules for natural language only
(code breaks them: short identifiers, symbols, few letters, repeated lines like `}` or `pass`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from dataprep.documents import Document

BULLETS = ("•", "●", "○", "▪", "-", "*", "·")
ELLIPSES = ("...", "…")


@dataclass(frozen=True)
class Rejection:
    filter: str  # stable name used in reports, e.g. "length.min_chars"
    detail: str  # human reason with the measured value and the bound


@dataclass(frozen=True)
class FilterSettings:
    # length bounds, every document
    min_chars: int = 1
    max_chars: int = 1_000_000
    # Gopher quality rules, natural-language (kind == "text") documents only: code breaks them
    gopher: bool = True
    min_words: int = 50
    max_words: int = 100_000
    min_mean_word_length: float = 3.0
    max_mean_word_length: float = 10.0
    max_symbol_word_ratio: float = 0.1  # '#' per word, and '...' / '…' per word, each
    max_ellipsis_line_fraction: float = 0.3  # lines ending in '...' or '…'
    max_bullet_line_fraction: float = 0.9  # lines starting with a bullet after whitespace
    min_alpha_word_fraction: float = 0.8  # words containing at least one alphabetic character
    # Gopher repetition rules, every document
    repetition: bool = True
    max_duplicate_line_fraction: float = 0.3  # duplicate lines / lines
    max_duplicate_line_char_fraction: float = 0.2  # chars in duplicate lines / chars
    max_top_ngram_char_fraction: tuple[tuple[int, float], ...] = ((2, 0.20), (3, 0.18), (4, 0.16))
    max_duplicate_ngram_char_fraction: tuple[tuple[int, float], ...] = (
        (5, 0.15),
        (6, 0.14),
        (7, 0.13),
        (8, 0.12),
        (9, 0.11),
        (10, 0.10),
    )

    def __post_init__(self) -> None:
        # Settings read from TOML arrive as lists; tuples keep the settings hashable.
        for name in _NGRAM_SETTINGS:
            try:
                pairs = tuple((int(n), float(f)) for n, f in getattr(self, name))
            except (TypeError, ValueError):
                raise ValueError(
                    f"{name} must be a list of [n, fraction] pairs, e.g. [[2, 0.2], [3, 0.18]]"
                ) from None
            object.__setattr__(self, name, pairs)
        _bounds(self, "min_chars", "max_chars")
        _bounds(self, "min_words", "max_words")
        _bounds(self, "min_mean_word_length", "max_mean_word_length")
        if self.max_symbol_word_ratio < 0:
            raise ValueError(f"max_symbol_word_ratio = {self.max_symbol_word_ratio} must be >= 0")
        for name in _FRACTION_SETTINGS:
            _fraction(name, getattr(self, name))
        for name in _NGRAM_SETTINGS:
            sizes = [n for n, _ in getattr(self, name)]
            for n, fraction in getattr(self, name):
                if n < 1:
                    raise ValueError(f"{name}: n-gram size {n} must be >= 1")
                _fraction(f"{name} for n = {n}", fraction)
            if len(set(sizes)) != len(sizes):
                raise ValueError(f"{name} lists an n-gram size twice ({sizes}): keep one of each")


_NGRAM_SETTINGS = ("max_top_ngram_char_fraction", "max_duplicate_ngram_char_fraction")
_FRACTION_SETTINGS = (
    "max_ellipsis_line_fraction",
    "max_bullet_line_fraction",
    "min_alpha_word_fraction",
    "max_duplicate_line_fraction",
    "max_duplicate_line_char_fraction",
)


def _bounds(settings: FilterSettings, low: str, high: str) -> None:
    lo, hi = getattr(settings, low), getattr(settings, high)
    if lo < 0:
        raise ValueError(f"{low} = {lo} must be >= 0")
    if lo > hi:
        raise ValueError(f"{low} = {lo} is above {high} = {hi}: no document could pass")


def _fraction(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} = {value} must be a fraction within [0, 1]")


class Filter(Protocol):
    name: str

    def check(self, doc: Document) -> Rejection | None: ...


def build_filters(settings: FilterSettings) -> list[Filter]:
    """The enabled filters, cheapest first, so most rejections cost the least work."""
    filters: list[Filter] = [LengthFilter(settings.min_chars, settings.max_chars)]
    if settings.gopher:
        filters.append(GopherQualityFilter(settings))
    if settings.repetition:
        filters.append(RepetitionFilter(settings))
    return filters


def first_rejection(filters: list[Filter], doc: Document) -> Rejection | None:
    for candidate in filters:
        rejection = candidate.check(doc)
        if rejection is not None:
            return rejection
    return None


def _num(value: float) -> str:
    """A measured value short enough to read: 11.3, 10.04, 50."""
    return f"{value:.2f}".rstrip("0").rstrip(".")


def _pct(fraction: float) -> str:
    return f"{_num(100 * fraction)}%"


class LengthFilter:
    name = "length"

    def __init__(self, min_chars: int, max_chars: int) -> None:
        self.min_chars = min_chars
        self.max_chars = max_chars

    def check(self, doc: Document) -> Rejection | None:
        chars = len(doc.text)
        if chars < self.min_chars:
            return Rejection("length.min_chars", f"{chars} chars < {self.min_chars}")
        if chars > self.max_chars:
            return Rejection("length.max_chars", f"{chars} chars > {self.max_chars}")
        return None


def _content_lines(text: str) -> list[str]:
    # Blank lines are layout: counting them would dilute every per-line fraction.
    return [line for line in (raw.strip() for raw in text.splitlines()) if line]


class GopherQualityFilter:
    name = "gopher"

    def __init__(self, settings: FilterSettings) -> None:
        self.s = settings

    def check(self, doc: Document) -> Rejection | None:
        if doc.kind != "text":
            return None
        s = self.s
        words = doc.text.split()
        count = len(words)
        if count < s.min_words:
            return Rejection("gopher.min_words", f"{count} words < {s.min_words}")
        if count > s.max_words:
            return Rejection("gopher.max_words", f"{count} words > {s.max_words}")
        if count == 0:
            return None  # min_words = 0 lets empty documents through; no ratio is defined
        mean = sum(map(len, words)) / count
        if mean < s.min_mean_word_length:
            detail = f"mean word length {_num(mean)} < {_num(s.min_mean_word_length)}"
            return Rejection("gopher.mean_word_length", detail)
        if mean > s.max_mean_word_length:
            detail = f"mean word length {_num(mean)} > {_num(s.max_mean_word_length)}"
            return Rejection("gopher.mean_word_length", detail)
        # Gopher bounds each symbol separately: "for either the hash symbol or the ellipsis".
        hashes = doc.text.count("#")
        ellipses = sum(doc.text.count(symbol) for symbol in ELLIPSES)
        for symbol, occurrences in (("'#'", hashes), ("ellipses", ellipses)):
            ratio = occurrences / count
            if ratio > s.max_symbol_word_ratio:
                detail = (
                    f"{symbol} per word {_num(ratio)} > {_num(s.max_symbol_word_ratio)} "
                    f"({occurrences} in {count} words)"
                )
                return Rejection("gopher.symbol_word_ratio", detail)
        lines = _content_lines(doc.text)
        if lines:
            bullets = sum(1 for line in lines if line.startswith(BULLETS)) / len(lines)
            if bullets > s.max_bullet_line_fraction:
                detail = (
                    f"{_pct(bullets)} of lines start with a bullet > "
                    f"{_pct(s.max_bullet_line_fraction)}"
                )
                return Rejection("gopher.bullet_lines", detail)
            trailing = sum(1 for line in lines if line.endswith(ELLIPSES)) / len(lines)
            if trailing > s.max_ellipsis_line_fraction:
                detail = (
                    f"{_pct(trailing)} of lines end with an ellipsis > "
                    f"{_pct(s.max_ellipsis_line_fraction)}"
                )
                return Rejection("gopher.ellipsis_lines", detail)
        alpha = sum(1 for word in words if any(map(str.isalpha, word))) / count
        if alpha < s.min_alpha_word_fraction:
            detail = f"{_pct(alpha)} of words contain a letter < {_pct(s.min_alpha_word_fraction)}"
            return Rejection("gopher.alpha_words", detail)
        return None


class RepetitionFilter:
    """Gopher's repetition rules: duplicate lines, then the top and the duplicated n-grams.

    Only repeated content counts: an n-gram that occurs once is not repetition, so a short
    document is never rejected because its single most frequent 2-gram is half of it.
    """

    name = "repetition"

    def __init__(self, settings: FilterSettings) -> None:
        self.s = settings

    def check(self, doc: Document) -> Rejection | None:
        if doc.kind != "text":  # repeated lines (`}`, `pass`, `end`) are normal in code
            return None
        return self._lines(doc.text) or self._ngrams(doc.text.split())

    def _lines(self, text: str) -> Rejection | None:
        lines = _content_lines(text)
        if not lines:
            return None
        seen: set[str] = set()
        duplicates = duplicate_chars = 0
        # The first occurrence is the original; only its repeats are duplicates.
        for line in lines:
            if line in seen:
                duplicates += 1
                duplicate_chars += len(line)
            else:
                seen.add(line)
        fraction = duplicates / len(lines)
        if fraction > self.s.max_duplicate_line_fraction:
            detail = (
                f"{_pct(fraction)} of lines are duplicates ({duplicates} of {len(lines)}) > "
                f"{_pct(self.s.max_duplicate_line_fraction)}"
            )
            return Rejection("repetition.duplicate_lines", detail)
        char_fraction = duplicate_chars / sum(map(len, lines))
        if char_fraction > self.s.max_duplicate_line_char_fraction:
            detail = (
                f"{_pct(char_fraction)} of line chars are in duplicate lines > "
                f"{_pct(self.s.max_duplicate_line_char_fraction)}"
            )
            return Rejection("repetition.duplicate_line_chars", detail)
        return None

    def _ngrams(self, words: list[str]) -> Rejection | None:
        if not words:
            return None
        grams = NGrams(words)
        for n, bound in self.s.max_top_ngram_char_fraction:
            top = grams.top_fraction(n)
            if top is not None and top[0] > bound:
                fraction, gram, times = top
                detail = (
                    f"most frequent {n}-gram {_quote(gram)} ({times} times) covers "
                    f"{_pct(fraction)} of word chars > {_pct(bound)}"
                )
                return Rejection(f"repetition.top_{n}gram", detail)
        for n, bound in self.s.max_duplicate_ngram_char_fraction:
            fraction = grams.duplicate_fraction(n)
            if fraction > bound:
                detail = f"repeated {n}-grams cover {_pct(fraction)} of word chars > {_pct(bound)}"
                return Rejection(f"repetition.duplicate_{n}gram", detail)
        return None


def _quote(words: Iterable[str], limit: int = 40) -> str:
    text = " ".join(words)
    return repr(text if len(text) <= limit else text[: limit - 1] + "…")


class NGrams:
    """Word n-grams as integer ids, built level by level so every n costs O(words).

    The id of the n-gram at i is the id of the pair (id of the (n-1)-gram at i, word i+n-1):
    two n-grams share an id exactly when their words are equal, without hashing n words each.
    """

    def __init__(self, words: list[str]) -> None:
        self.words = words
        self.lengths = [len(word) for word in words]
        self.total_chars = sum(self.lengths)
        vocabulary: dict[str, int] = {}
        self._levels: dict[int, list[int]] = {
            1: [vocabulary.setdefault(word, len(vocabulary)) for word in words]
        }

    def ids(self, n: int) -> list[int]:
        """The id of the n-gram starting at each position (len(words) - n + 1 of them)."""
        if n in self._levels:
            return self._levels[n]
        unigrams = self._levels[1]
        level = max(k for k in self._levels if k < n)
        previous = self._levels[level]
        while level < n:
            level += 1
            pairs: dict[tuple[int, int], int] = {}
            previous = [
                pairs.setdefault(pair, len(pairs))
                for pair in zip(previous, unigrams[level - 1 :], strict=False)
            ]
            self._levels[level] = previous
        return previous

    def top_fraction(self, n: int) -> tuple[float, list[str], int] | None:
        """(fraction of word chars the most frequent repeated n-gram covers, it, its count)."""
        ids = self.ids(n)
        counts = Counter(ids)
        if not counts or self.total_chars == 0:
            return None
        most = max(counts.values())
        if most < 2:
            return None
        # Ties go to the n-gram covering most characters: the verdict must not depend on order.
        tied = {gram for gram, count in counts.items() if count == most}
        covered: Counter[int] = Counter()
        covered_until: dict[int, int] = {}
        first_at: dict[int, int] = {}
        for i, gram in enumerate(ids):
            if gram in tied:
                first_at.setdefault(gram, i)
                # Overlapping occurrences ("a a a") cover each word once.
                start = max(i, covered_until.get(gram, 0))
                covered[gram] += sum(self.lengths[start : i + n])
                covered_until[gram] = i + n
        best = max(tied, key=lambda gram: (covered[gram], -first_at[gram]))
        start = first_at[best]
        return covered[best] / self.total_chars, self.words[start : start + n], most

    def duplicate_fraction(self, n: int) -> float:
        """Fraction of word chars inside some n-gram that occurs more than once."""
        ids = self.ids(n)
        if not ids or self.total_chars == 0:
            return 0.0
        counts = Counter(ids)
        if len(counts) == len(ids):
            return 0.0  # nothing repeats
        chars = covered_until = 0
        for i, gram in enumerate(ids):
            if counts[gram] > 1:
                # Positions only move forward, so each word is counted at most once.
                chars += sum(self.lengths[max(i, covered_until) : i + n])
                covered_until = i + n
        return chars / self.total_chars
