"""Pack token streams into fixed-size shard files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from infra.digest import sha256_file


def token_dtype(vocab_size: int) -> np.dtype:
    """Two bytes a token while the vocabulary fits, four beyond."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@dataclass
class ShardFile:
    path: Path
    tokens: int
    bytes: int
    sha256: str


class ShardWriter:
    """Buffers tokens into `<prefix>-NNNNN.bin` files of `shard_tokens` each (the last: fewer)."""

    def __init__(self, folder: Path, prefix: str, shard_tokens: int, dtype: np.dtype) -> None:
        self.folder = folder
        self.prefix = prefix
        self.shard_tokens = shard_tokens
        self.dtype = dtype
        self.files: list[ShardFile] = []
        self._buffer = np.empty(shard_tokens, dtype=dtype)
        self._filled = 0

    @property
    def tokens(self) -> int:
        return sum(f.tokens for f in self.files) + self._filled

    def add(self, ids: list[int] | np.ndarray) -> None:
        tokens = np.asarray(ids, dtype=self.dtype)
        while len(tokens):
            room = self.shard_tokens - self._filled
            take = tokens[:room]
            self._buffer[self._filled : self._filled + len(take)] = take
            self._filled += len(take)
            tokens = tokens[room:]
            if self._filled == self.shard_tokens:
                self._flush()

    def close(self) -> list[ShardFile]:
        if self._filled:
            self._flush()
        return self.files

    def _flush(self) -> None:
        path = self.folder / f"{self.prefix}-{len(self.files):05d}.bin"
        self._buffer[: self._filled].tofile(path)
        self.files.append(ShardFile(path, self._filled, path.stat().st_size, sha256_file(path)))
        self._filled = 0
