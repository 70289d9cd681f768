"""Every setting of data preparation in one frozen tree; its identity names the snapshot."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from dataprep.filters import FilterSettings
from dataprep.minhash import MinHashSettings
from dataprep.readers import ReaderSettings
from dataprep.tokenizer import TokenizerKind


@dataclass(frozen=True)
class DedupSettings:
    exact: bool = True
    near: bool = True
    minhash: MinHashSettings = field(default_factory=MinHashSettings)
    verify: bool = False  # check every candidate pair's exact Jaccard against `threshold`
    threshold: float = 0.8
    memory_limit: str = "1GB"  # DuckDB's budget; beyond it the index spills to disk

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError("dedup.threshold must be in (0, 1]")


@dataclass(frozen=True)
class TokenizerSettings:
    kind: TokenizerKind = "char"
    vocab_size: int = 8192  # for bpe
    train_bytes: int = 200_000_000  # bpe trains on at most this much deduplicated train text

    def __post_init__(self) -> None:
        if self.kind == "bpe" and not 257 <= self.vocab_size <= 1 << 20:
            raise ValueError("data.vocab_size must be between 257 and 1048576 for bpe")


@dataclass(frozen=True)
class SnapshotSettings:
    reader: ReaderSettings = field(default_factory=ReaderSettings)
    filters: FilterSettings = field(default_factory=FilterSettings)
    dedup: DedupSettings = field(default_factory=DedupSettings)
    tokenizer: TokenizerSettings = field(default_factory=TokenizerSettings)
    val_fraction: float = 0.1
    shard_tokens: int = 1 << 20
    chunk_bytes: int = 64 << 20  # sources are grouped into chunks of about this size

    def identity(self) -> dict:
        """What changes the snapshot's bytes: everything but the memory budget."""
        data = asdict(self)
        del data["dedup"]["memory_limit"]
        return data
