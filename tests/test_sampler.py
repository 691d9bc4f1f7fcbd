import pytest
import torch
from torch.utils.data import DistributedSampler

from ddplab.data.sampler import ResumableDistributedSampler


@pytest.mark.parametrize("n", [10, 11, 17])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_same_order_as_torch_distributed_sampler(n, world):
    data = list(range(n))
    for rank in range(world):
        ours = ResumableDistributedSampler(data, world, rank, seed=7)
        theirs = DistributedSampler(data, world, rank, seed=7)
        ours.set_epoch(3)
        theirs.set_epoch(3)
        assert list(ours) == list(theirs) and len(ours) == len(theirs)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_resume_is_a_slice_of_the_uninterrupted_order(world):
    data = list(range(23))
    for rank in range(world):
        full = list(ResumableDistributedSampler(data, world, rank, seed=1))
        for k in range(len(full)):
            s = ResumableDistributedSampler(data, world, rank, seed=1)
            s.set_epoch(0, start=k * world)
            assert list(s) == full[k:] and len(s) == len(full) - k


@pytest.mark.parametrize("old_world, new_world", [(2, 3), (4, 2), (3, 1)])
def test_changed_world_size_neither_repeats_nor_skips(old_world, new_world):
    data = list(range(40))
    consumed = 3 * old_world * 2  # three batches of two per rank
    seen = set()
    for rank in range(old_world):
        s = ResumableDistributedSampler(data, old_world, rank, seed=5)
        seen.update(list(s)[:6])
    rest = []
    for rank in range(new_world):
        s = ResumableDistributedSampler(data, new_world, rank, seed=5)
        s.set_epoch(0, start=consumed)
        rest += list(s)
    remaining = set(data) - seen
    fresh = [i for i in rest if i not in seen]
    assert sorted(fresh) == sorted(remaining)  # every unseen sample exactly once
    assert len(rest) - len(fresh) == -len(remaining) % new_world  # the rest is padding only
    shares = {len(list(iter_rank)) for iter_rank in _ranks(data, new_world, consumed)}
    assert len(shares) == 1  # equal shares, or DDP would hang


def _ranks(data, world, start):
    for rank in range(world):
        s = ResumableDistributedSampler(data, world, rank, seed=5)
        s.set_epoch(0, start=start)
        yield s


def test_evaluation_loaders_count_each_sample_once():
    from types import SimpleNamespace as NS

    from ddplab.engine.loop.loaders import Loaders

    d = NS(num_workers=0, pin_memory=False)
    shards = []
    for rank in range(3):
        ctx = NS(rank=rank, world_size=3, device=torch.device("cpu"), launch=NS(local_world_size=3))
        shards.append([int(i) for batch in Loaders(d, ctx, None, 2, 0).evaluation(list(range(11))) for i in batch])
    assert [len(s) for s in shards] == [4, 4, 3]  # no padding
    assert sorted(sum(shards, [])) == list(range(11))


class _CountingDataset:
    """Counts item reads: resuming must read the next batch, not the ones before it."""

    def __init__(self, n: int) -> None:
        self.n, self.reads = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.reads += 1
        return i


@pytest.mark.parametrize("position", [0.1, 0.9])
def test_resume_seeks_without_reading_the_consumed_batches(position):
    from torch.utils.data import DataLoader

    data = _CountingDataset(10_000)
    consumed = int(len(data) * position) // 16 * 16  # whole global batches of 2 ranks x 8
    sampler = ResumableDistributedSampler(data, 2, 1, seed=3)
    sampler.set_epoch(4, start=consumed)
    first = next(iter(DataLoader(data, batch_size=8, sampler=sampler)))
    assert data.reads == 8  # one batch read, whatever the position
    unbroken = DistributedSampler(data, 2, 1, seed=3)
    unbroken.set_epoch(4)
    assert first.tolist() == list(unbroken)[consumed // 2 : consumed // 2 + 8]
