"""Small corpora with known contents for the data-preparation tests."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

VOCABULARY = [
    f"{a}{b}" for a in ("ka", "lo", "mi", "ne", "su", "ta", "re", "vo") for b in "aeiouxyz"
]


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(VOCABULARY) + rng.choice(("", "n", "s", "r")) for _ in range(words))


def edit(rng: random.Random, text: str, substitutions: int) -> str:
    words = text.split(" ")
    for i in rng.sample(range(len(words)), substitutions):
        words[i] = f"edit{rng.randrange(10**6)}"
    return " ".join(words)


@dataclass
class Planted:
    """Where the planted copies are, by (source, JSONL line): what near-dedup must find."""

    path: Path
    near_copies: list[int] = field(default_factory=list)  # lines that copy a base at J ≈ 0.87
    distant: list[int] = field(default_factory=list)  # lines that share ~half: J ≈ 0.5
    exact_copies: list[int] = field(default_factory=list)
    total: int = 0


def planted_jsonl(path: Path, seed: int = 0, bases: int = 300) -> Planted:
    """`bases` documents of 150 words, a near copy (2 words changed: ~10 of 146 5-word shingles,
    Jaccard ≈ 0.87) of a third of them, a distant variant (15 words changed, J ≈ 0.5) of another
    third, and exact copies (after normalization) of a few."""
    rng = random.Random(seed)
    planted = Planted(path)
    lines: list[str] = []
    originals = [sentence(rng, 150) for _ in range(bases)]
    for i, base in enumerate(originals):
        lines.append(base)
        if i % 3 == 0:
            lines.append(edit(rng, base, 2))
            planted.near_copies.append(len(lines))
        elif i % 3 == 1:
            lines.append(edit(rng, base, 15))
            planted.distant.append(len(lines))
        if i % 50 == 0:
            lines.append(base.upper())  # the same text after normalization
            planted.exact_copies.append(len(lines))
    path.write_text("\n".join(json.dumps({"text": line, "id": n}) for n, line in enumerate(lines)))
    planted.total = len(lines)
    return planted
