import random

import pytest

from dataprep.documents import Document
from dataprep.filters import (
    FilterSettings,
    GopherQualityFilter,
    LengthFilter,
    NGrams,
    Rejection,
    RepetitionFilter,
    build_filters,
    first_rejection,
)

PROSE = (
    "The river ran past the old mill where farmers brought their grain every autumn.\n"
    "Children watched the wheel turn slowly while merchants argued about prices near the gate.\n"
    "By evening the square emptied, lanterns were lit, and a fiddler played for coins.\n"
    "Nobody remembered who had built the bridge, though several families claimed an ancestor "
    "had carried its stones across the valley on a cart pulled by oxen.\n"
    "Visitors rarely stayed longer than one night, because the inn served thin soup and "
    "charged heavily for straw beds."
)
DEFAULTS = FilterSettings()


def text(body: str) -> Document:
    return Document(body, "/corpus/a.txt", 0)


def code(body: str) -> Document:
    return Document(body, "/repo/m.py", 0, "code", "python")


def reject(doc: Document, settings: FilterSettings = DEFAULTS) -> Rejection | None:
    return first_rejection(build_filters(settings), doc)


def distinct_words(count: int, length: int = 5) -> list[str]:
    # Letters only, all different, all `length` long: neutral for every rule.
    words, i = [], 0
    while len(words) < count:
        word = "".join(chr(ord("a") + (i // 26**k) % 26) for k in range(length))
        words.append(word)
        i += 7919  # a prime stride keeps neighbours unalike
    return words


def test_natural_prose_passes_every_filter() -> None:
    assert len(PROSE.split()) == 87
    assert reject(text(PROSE)) is None
    assert [f.name for f in build_filters(DEFAULTS)] == ["length", "gopher", "repetition"]
    assert [f.name for f in build_filters(FilterSettings(gopher=False, repetition=False))] == [
        "length"
    ]


def test_length_bounds_apply_to_every_document() -> None:
    assert reject(code("")) == Rejection("length.min_chars", "0 chars < 1")
    short = FilterSettings(max_chars=100)
    assert reject(code("x = 1\n" * 20), short) == Rejection("length.max_chars", "120 chars > 100")
    assert LengthFilter(1, 10).check(text("0123456789")) is None


def test_word_count_bounds() -> None:
    assert reject(text("Short text here.")) == Rejection("gopher.min_words", "3 words < 50")
    few = FilterSettings(max_words=60)
    assert reject(text(PROSE), few) == Rejection("gopher.max_words", "87 words > 60")


def test_mean_word_length_bounds() -> None:
    tiny = " ".join(distinct_words(60, length=2))
    assert reject(text(tiny)) == Rejection("gopher.mean_word_length", "mean word length 2 < 3")
    long = " ".join(distinct_words(60, length=12))
    assert reject(text(long)) == Rejection("gopher.mean_word_length", "mean word length 12 > 10")


def test_symbol_to_word_ratio_for_hashes_and_ellipses_each() -> None:
    hashes = PROSE + " " + " ".join(f"#{w}" for w in distinct_words(22))
    rejection = reject(text(hashes))
    assert rejection == Rejection(
        "gopher.symbol_word_ratio", "'#' per word 0.2 > 0.1 (22 in 109 words)"
    )
    dots = PROSE + " " + " ".join(f"{w}... {w}…" for w in distinct_words(6))
    rejection = reject(text(dots))
    assert rejection == Rejection(
        "gopher.symbol_word_ratio", "ellipses per word 0.12 > 0.1 (12 in 99 words)"
    )


def test_bullet_lines() -> None:
    words = distinct_words(120)
    lines = [f"{'•' if i % 2 else '-'} " + " ".join(words[i * 4 : i * 4 + 4]) for i in range(30)]
    rejection = reject(text("\n\n".join(lines)))  # blank lines between do not count
    assert rejection == Rejection("gopher.bullet_lines", "100% of lines start with a bullet > 90%")
    lines[:3] = [line.lstrip("-• ") for line in lines[:3]]
    assert reject(text("\n".join(lines))) is None  # 90% is not above 90%


def test_ellipsis_lines() -> None:
    words = distinct_words(100)
    lines = [" ".join(words[i * 10 : i * 10 + 10]) for i in range(10)]
    for i in range(4):
        lines[i] += "..."
    rejection = reject(text("\n".join(lines)))
    assert rejection == Rejection(
        "gopher.ellipsis_lines", "40% of lines end with an ellipsis > 30%"
    )
    lines[0] = lines[0].rstrip(".")
    assert reject(text("\n".join(lines))) is None  # 30% is not above 30%


def test_words_with_letters() -> None:
    numbers = PROSE + " " + " ".join(str(10_000 + i) for i in range(30))
    rejection = reject(text(numbers))
    assert rejection == Rejection(
        "gopher.alpha_words", "74.36% of words contain a letter < 80%"
    )  # 87 of 117


def test_code_skips_the_gopher_rules_but_not_length() -> None:
    snippet = "x = 1\nprint(x)\n"
    assert reject(code(snippet)) is None  # 4 words would fail gopher.min_words as text
    assert reject(text(snippet)) == Rejection("gopher.min_words", "4 words < 50")
    # Repeated lines are normal in code (`}`, `pass`, `end`): the repetition rules skip it.
    repeated = "setup()\n" + "step()\n" * 5
    assert reject(code(repeated)) is None
    assert RepetitionFilter(DEFAULTS).check(text(repeated)) == Rejection(
        "repetition.duplicate_lines", "66.67% of lines are duplicates (4 of 6) > 30%"
    )
    assert GopherQualityFilter(DEFAULTS).check(code("")) is None
    assert reject(code("")) == Rejection("length.min_chars", "0 chars < 1")


def test_duplicate_lines_and_duplicate_line_chars() -> None:
    check = RepetitionFilter(DEFAULTS).check
    lines = ["one", "a second line of prose", "then something else entirely", "one"]
    assert check(text("\n".join(lines))) is None  # 1 of 4 lines, 3 of 57 chars
    rejection = check(text("\n".join([*lines, "  one  "])))
    assert rejection == Rejection(
        "repetition.duplicate_lines", "40% of lines are duplicates (2 of 5) > 30%"
    )
    long = "a long line that repeats with many characters in it"  # 51 chars
    shorts = [f"x{i}" for i in range(7)]
    rejection = check(text("\n".join([long, *shorts, long, long])))
    # 2 of 10 lines, but 102 of 167 chars
    assert rejection == Rejection(
        "repetition.duplicate_line_chars", "61.08% of line chars are in duplicate lines > 20%"
    )


def test_most_frequent_ngram() -> None:
    doc = text("alpha beta alpha beta gamma delta epsilon zeta eta theta")
    rejection = RepetitionFilter(DEFAULTS).check(doc)
    assert rejection == Rejection(
        "repetition.top_2gram",
        "most frequent 2-gram 'alpha beta' (2 times) covers 38.3% of word chars > 20%",
    )  # 18 of 47 word chars
    # An n-gram seen once is not repetition, however short the document.
    assert RepetitionFilter(DEFAULTS).check(text("just three words")) is None


def test_duplicated_ngrams_count_each_word_once() -> None:
    # 45 distinct words and one 5-gram twice: the top 2/3/4-grams stay under their bounds
    # (4, 6, 8 of 55 words) while the repeated 5-gram covers 10 of 55 words.
    words = distinct_words(50, length=4)
    repeated = words[45:50]
    doc = text(" ".join([*words[:20], *repeated, *words[20:45], *repeated]))
    rejection = RepetitionFilter(DEFAULTS).check(doc)
    assert rejection == Rejection(
        "repetition.duplicate_5gram", "repeated 5-grams cover 18.18% of word chars > 15%"
    )


def test_ngram_coverage_by_hand() -> None:
    grams = NGrams(["a", "bb", "a", "bb", "a", "bb", "c"])  # 10 word chars
    assert grams.top_fraction(2) == (9 / 10, ["a", "bb"], 3)  # overlaps count once
    assert grams.top_fraction(6) is None  # every 6-gram occurs once
    assert grams.duplicate_fraction(3) == 9 / 10  # "a bb a" and "bb a bb" twice each
    assert grams.duplicate_fraction(5) == 0.0
    assert grams.duplicate_fraction(9) == 0.0  # longer than the document
    assert grams.ids(2) == [0, 1, 0, 1, 0, 2]
    same = NGrams(["x", "y", "z", "x", "y", "z"])
    assert same.duplicate_fraction(3) == 1.0 and same.top_fraction(3) == (1.0, ["x", "y", "z"], 2)


def test_repetition_on_a_long_document() -> None:
    rng = random.Random(0)
    vocabulary = distinct_words(5000, length=6)
    words = [rng.choice(vocabulary) for _ in range(100_000)]
    words += words[:100]  # one repeated passage: 200 of 100,100 equally long words
    doc = text("\n".join(" ".join(words[i : i + 15]) for i in range(0, len(words), 15)))
    assert RepetitionFilter(DEFAULTS).check(doc) is None
    grams = NGrams(words)
    assert [grams.duplicate_fraction(n) for n in (5, 10)] == [200 / 100_100] * 2


def test_filter_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="min_chars = 10 is above max_chars = 5"):
        FilterSettings(min_chars=10, max_chars=5)
    with pytest.raises(ValueError, match="min_words = -1 must be >= 0"):
        FilterSettings(min_words=-1)
    with pytest.raises(ValueError, match="min_mean_word_length = 5 is above max_mean_word_length"):
        FilterSettings(min_mean_word_length=5, max_mean_word_length=4)
    with pytest.raises(ValueError, match=r"max_bullet_line_fraction = 1\.5 must be a fraction"):
        FilterSettings(max_bullet_line_fraction=1.5)
    with pytest.raises(ValueError, match=r"max_symbol_word_ratio = -0\.1"):
        FilterSettings(max_symbol_word_ratio=-0.1)
    with pytest.raises(ValueError, match="max_top_ngram_char_fraction: n-gram size 0"):
        FilterSettings(max_top_ngram_char_fraction=((0, 0.2),))
    with pytest.raises(ValueError, match=r"for n = 5 = 2\.0 must be a fraction"):
        FilterSettings(max_duplicate_ngram_char_fraction=((5, 2.0),))
    with pytest.raises(ValueError, match="lists an n-gram size twice"):
        FilterSettings(max_top_ngram_char_fraction=((2, 0.2), (2, 0.3)))
    with pytest.raises(ValueError, match="list of \\[n, fraction\\] pairs"):
        FilterSettings(max_top_ngram_char_fraction=(2, 0.2))  # type: ignore[arg-type]
    from_toml = FilterSettings(max_top_ngram_char_fraction=[[2, 0.25]])  # type: ignore[arg-type]
    assert from_toml.max_top_ngram_char_fraction == ((2, 0.25),)
    assert hash(from_toml)
