"""The sample order is world-size invariant and restarts exactly at a step boundary."""

from __future__ import annotations

import itertools

import pytest

from disttrain.data.sampling import ResumableShardedSampler, ShardedEvalSampler


def take(sampler: ResumableShardedSampler, n: int) -> list[int]:
    return list(itertools.islice(iter(sampler), n))


@pytest.mark.parametrize("world", [2, 4])
def test_union_of_rank_batches_is_the_single_process_batch(world: int) -> None:
    # 96 samples per epoch is a multiple of every world size here, so no rank drops an epoch tail and the
    # comparison spans several epochs (30 steps x 4 x world samples).
    dataset_len, micro, steps = 96, 4, 30
    single = take(ResumableShardedSampler(dataset_len, 1, 0, seed=3), steps * micro * world)
    ranks = [take(ResumableShardedSampler(dataset_len, world, r, seed=3), steps * micro) for r in range(world)]
    for step in range(steps):
        sharded = [i for rank in ranks for i in rank[step * micro : (step + 1) * micro]]
        assert sorted(sharded) == sorted(single[step * micro * world : (step + 1) * micro * world])


def test_each_epoch_is_a_permutation_and_epochs_differ() -> None:
    sampler = ResumableShardedSampler(50, 1, 0, seed=1)
    stream = take(sampler, 150)
    epochs = [stream[i * 50 : (i + 1) * 50] for i in range(3)]
    assert all(sorted(e) == list(range(50)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]


@pytest.mark.parametrize("start", [0, 8, 96, 100, 1000])
def test_resume_continues_the_stream_exactly(start: int) -> None:
    for rank in range(2):
        full = take(ResumableShardedSampler(97, 2, rank, seed=5), 700)
        resumed = take(ResumableShardedSampler(97, 2, rank, seed=5, start_sample=start), 100)
        assert resumed == full[start // 2 : start // 2 + 100]


def test_rejects_impossible_arguments() -> None:
    with pytest.raises(ValueError, match="rank"):
        ResumableShardedSampler(10, 2, 2, seed=0)
    with pytest.raises(ValueError, match="multiple"):
        ResumableShardedSampler(10, 2, 0, seed=0, start_sample=3)
    with pytest.raises(ValueError, match="cannot be shared"):
        ResumableShardedSampler(1, 2, 0, seed=0)


def test_eval_sampler_shards_without_overlap() -> None:
    shards = [list(ShardedEvalSampler(11, 2, r)) for r in range(2)]
    assert shards == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    assert len(ShardedEvalSampler(11, 2, 0)) == 5
