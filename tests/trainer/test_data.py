from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.data import TokenStream, sequential_batches, step_batch
from trainer.errors import DataError


@pytest.fixture
def stream(tmp_path: Path) -> TokenStream:
    paths = []
    for i, length in enumerate([1000, 37, 500]):
        path = tmp_path / f"train-{i:05d}.bin"
        np.arange(i * 10_000, i * 10_000 + length, dtype=np.uint16).tofile(path)
        paths.append(path)
    return TokenStream(paths, "uint16", block_size=32)


def test_windows_stay_inside_a_shard(stream: TokenStream) -> None:
    assert stream.windows == (1000 - 32) + (37 - 32) + (500 - 32)
    for index in range(stream.windows):
        window = stream.window(index)
        assert len(window) == 33 and np.all(np.diff(window) == 1)


def test_batch_of_a_step_is_deterministic_and_independent_of_world_size(
    stream: TokenStream,
) -> None:
    x1, y1 = step_batch(stream, seed=7, step=3, global_batch=8, rank=0, world=1)
    x1b, _ = step_batch(stream, seed=7, step=3, global_batch=8, rank=0, world=1)
    assert torch.equal(x1, x1b)
    halves = [step_batch(stream, seed=7, step=3, global_batch=8, rank=r, world=2) for r in (0, 1)]
    assert torch.equal(torch.cat([h[0] for h in halves]), x1)
    assert torch.equal(torch.cat([h[1] for h in halves]), y1)
    assert torch.equal(y1[:, :-1], x1[:, 1:])  # targets are inputs shifted by one
    other, _ = step_batch(stream, seed=7, step=4, global_batch=8, rank=0, world=1)
    assert not torch.equal(other, x1)


def test_sequential_batches_do_not_overlap(stream: TokenStream) -> None:
    seen = torch.cat([x.flatten() for x, _ in sequential_batches(stream, 4, 100)])
    assert len(seen) == len(set(seen.tolist()))
    assert len(list(sequential_batches(stream, 4, 2))) == 2


def test_too_little_data_names_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "val-00000.bin"
    np.arange(10, dtype=np.uint16).tofile(path)
    with pytest.raises(DataError, match=r"lower model\.block_size or add data"):
        TokenStream([path], "uint16", block_size=32)
