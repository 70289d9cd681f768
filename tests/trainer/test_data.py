"""Samples, their order per epoch, and each data-parallel rank's slice."""

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.data import (
    ORDER_BLOCK,
    RankSlice,
    SampleOrder,
    Sampler,
    TokenStream,
    rank_batches,
    sequential_batches,
    to_device,
)
from trainer.errors import DataError


@pytest.fixture
def stream(tmp_path: Path) -> TokenStream:
    paths = []
    for i, n in enumerate((1000, 37, 500)):
        path = tmp_path / f"s{i}.bin"
        np.arange(n, dtype=np.uint16).tofile(path)
        paths.append(path)
    return TokenStream(paths, "uint16", block_size=32)


def test_samples_tile_each_shard_without_crossing_it(stream: TokenStream) -> None:
    assert stream.samples == 999 // 32 + 36 // 32 + 499 // 32
    for index in range(stream.samples):
        sample = stream.sample(index)
        assert len(sample) == 33
        assert np.all(np.diff(sample) == 1), "a sample crossed a shard boundary"


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**31 - 1), epoch=st.integers(0, 50))
def test_each_epoch_is_a_permutation(n: int, seed: int, epoch: int) -> None:
    order = SampleOrder(n, seed)
    indices = order.indices(epoch, np.arange(n))
    assert sorted(indices.tolist()) == list(range(n))
    assert np.array_equal(indices, SampleOrder(n, seed).indices(epoch, np.arange(n)))


def test_epochs_and_seeds_shuffle_differently() -> None:
    order = SampleOrder(1000, seed=7)
    first, second = order.indices(0, np.arange(1000)), order.indices(1, np.arange(1000))
    assert not np.array_equal(first, second)
    assert not np.array_equal(first, SampleOrder(1000, seed=8).indices(0, np.arange(1000)))
    assert not np.array_equal(first, np.arange(1000)), "not shuffled at all"


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_the_global_batch_does_not_depend_on_how_many_ranks_share_it(
    stream: TokenStream, dp_size: int
) -> None:
    whole = Sampler(stream, 3, 8, RankSlice(0, 1, 1)).global_indices(40)
    slices = [
        Sampler(stream, 3, 8, RankSlice(r, dp_size, 1)).rank_indices(40) for r in range(dp_size)
    ]
    assert np.array_equal(np.concatenate(slices), whole)


def test_a_cursor_across_an_epoch_boundary_continues_in_the_next_epoch(
    stream: TokenStream,
) -> None:
    sampler = Sampler(stream, 3, 8, RankSlice(0, 1, 1))
    n = stream.samples
    seen = np.concatenate([sampler.global_indices(c) for c in range(0, 2 * n - 8, 8)])
    assert sorted(seen[:n].tolist()) == list(range(n)), "epoch 0 is not every sample once"
    assert sampler.epoch(n - 1) == 0 and sampler.epoch(n) == 1


@pytest.mark.parametrize("batch", [8, 24, ORDER_BLOCK + 8])
def test_batches_read_from_precomputed_blocks_are_the_order_itself(
    stream: TokenStream, batch: int
) -> None:
    """The sampler computes the order a block of positions at a time and keeps the blocks in
    use: a batch straddling two blocks, an epoch boundary or spanning whole blocks, read in any
    order (a resume jumps), is what SampleOrder says position by position."""
    sampler = Sampler(stream, 5, batch, RankSlice(0, 1, 1))
    n = stream.samples
    cursors = [ORDER_BLOCK - 4, 0, 3 * ORDER_BLOCK - batch // 2, 7 * n - 3, ORDER_BLOCK - 4]
    for cursor in cursors:
        positions = np.arange(cursor, cursor + batch)
        expected = [sampler.order.indices(int(p // n), np.array([p % n]))[0] for p in positions]
        assert sampler.global_indices(cursor).tolist() == expected, f"cursor {cursor}"


def test_micro_batches_split_the_rank_slice(stream: TokenStream) -> None:
    sampler = Sampler(stream, 3, 8, RankSlice(1, 2, 2))
    parts = list(sampler.micro_batches(16))
    assert len(parts) == 2
    assert np.array_equal(np.concatenate([p[0] for p in parts]), sampler.rank_indices(16))
    x, y = parts[0][1], parts[0][2]
    assert x.shape == y.shape == (2, 32) and torch.equal(x[:, 1:], y[:, :-1])


def test_a_batch_that_does_not_split_is_refused(stream: TokenStream) -> None:
    with pytest.raises(ValueError, match="divisible by data-parallel ranks"):
        Sampler(stream, 3, 10, RankSlice(0, 4, 1))


def test_sequential_batches_do_not_overlap(stream: TokenStream) -> None:
    seen = torch.cat([y.flatten() for _, y in sequential_batches(stream, 4, 100)])
    assert len(seen) == stream.samples * 32
    assert len(list(sequential_batches(stream, 4, 2))) == 2


def test_too_little_data_names_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "tiny.bin"
    np.arange(10, dtype=np.uint16).tofile(path)
    with pytest.raises(DataError, match=r"lower model\.block_size or add data"):
        TokenStream([path], "uint16", block_size=32)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_rank_batches_share_the_evaluation_batches_evenly(stream: TokenStream, ranks: int) -> None:
    everything = [y for _, y in sequential_batches(stream, 4, 7)]
    shares = [list(rank_batches(stream, 4, 7, r, ranks)) for r in range(ranks)]
    assert len({len(share) for share in shares}) == 1, "every rank runs as many forwards"
    counted = [y for share in shares for _, y, counts in share if counts]
    assert sorted(t.flatten().tolist() for t in counted) == sorted(
        t.flatten().tolist() for t in everything
    )


def test_a_batch_for_a_cpu_run_is_handed_over_as_it_is(stream: TokenStream) -> None:
    """No pinning off a GPU (page-locked memory needs one): the CPU tensor itself, unchanged.
    The GPU's path (pinned, copied without waiting) needs a GPU to run."""
    x, _ = stream.batch(np.array([3, 1]))
    moved = to_device(x, torch.device("cpu"))
    assert moved is x and not moved.is_pinned()
