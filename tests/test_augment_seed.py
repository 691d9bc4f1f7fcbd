"""Random augmentation drawn from a per-sample seed (data.per_sample_seed): a sample is augmented the same
whatever the world size, and verify passes on a workload with random augmentation."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import assert_ok
from conftest import ddplab as ddplab_cli
from torch.utils.data import Dataset

from ddplab.data.sample_seed import PerSampleSeed
from ddplab.data.sampler import ResumableDistributedSampler

JITTER = '''
import pytest
import torch
from torch.utils.data import Dataset

import ddplab


class RandomJitter:
    def __call__(self, x):
        return x + 0.5 * torch.rand(x.shape)


class Points(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 4, generator=g), torch.randn(n, generator=g)
        self.transform = RandomJitter()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.transform(self.x[i]), self.y[i]


def data(cfg):
    return ddplab.Data(train=Points(64), val=Points(16), task=ddplab.Regression())


def model(cfg, data):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1), torch.nn.Flatten(0))
'''


class Noisy(Dataset):
    """Sample i is i plus noise drawn from torch's global generator."""

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int):
        return torch.full((3,), float(i)) + torch.rand(3), i


def _seen(world: int, epoch: int, seed: int = 7) -> dict[int, torch.Tensor]:
    """Sample id -> the augmented tensor, over every rank of a `world`-process epoch (batch 2 per rank)."""
    seen = {}
    for rank in range(world):
        sampler = ResumableDistributedSampler(Noisy(), world, rank, shuffle=True, seed=seed)
        sampler.keyed = True
        sampler.set_epoch(epoch)
        torch.manual_seed(100 + rank)  # each rank's own stream, as in training
        loader = torch.utils.data.DataLoader(PerSampleSeed(Noisy(), seed), batch_size=2, sampler=sampler)
        for x, ids in loader:
            seen.update(zip(ids.tolist(), x))
    return seen


def test_one_and_two_processes_see_the_same_augmented_samples():
    one, two = _seen(1, epoch=3), _seen(2, epoch=3)
    assert sorted(one) == sorted(two) == list(range(20))
    for i in one:
        assert torch.equal(one[i], two[i]), i
    noise = torch.stack([one[i] - i for i in sorted(one)])
    assert noise.std() > 0.1  # the augmentation draws: not the same noise everywhere
    other = _seen(1, epoch=4)
    assert not any(torch.equal(one[i], other[i]) for i in one)  # a new epoch, new draws


def test_reading_leaves_the_callers_random_streams_as_they_were():
    seeded = PerSampleSeed(Noisy(), 0)
    torch.manual_seed(1)
    random.seed(1)
    expected = torch.rand(4), random.random()
    torch.manual_seed(1)
    random.seed(1)
    seeded[(0, 5)], seeded.__getitems__([(0, 1), (0, 2)])
    assert torch.equal(torch.rand(4), expected[0]) and random.random() == expected[1]
    assert torch.equal(seeded[(2, 5)][0], seeded[(2, 5)][0])  # the same sample and epoch, the same draws


def test_verify_passes_with_random_augmentation(tmp_path):
    workload = tmp_path / "jitter.py"
    workload.write_text(JITTER)
    args = [f"data.name={workload}:data", f"model.name={workload}:model", "training.batch_size=4",
            "training.max_steps=6", "logging.trackers=[]", f"experiment.output_dir={tmp_path / 'runs'}"]
    proc = ddplab_cli("verify", "--nproc", "2", *args, cwd=tmp_path)
    assert_ok(proc)
    assert "random transforms on the training set (RandomJitter) drawn from per-sample seeds" in proc.stdout
    assert "PASS" in proc.stdout, proc.stdout


def test_datasets_that_fetch_whole_batches_keep_doing_so_unless_they_transform():
    datasets = pytest.importorskip("datasets")
    plain = datasets.Dataset.from_dict({"x": [1.0, 2.0, 3.0], "label": [0, 1, 0]})
    assert PerSampleSeed(plain, 0).whole_batches
    assert not PerSampleSeed(plain.with_transform(lambda b: b), 0).whole_batches  # may draw: item by item
    assert not PerSampleSeed(Noisy(), 0).whole_batches
    assert PerSampleSeed(plain, 0).__getitems__([(1, 0), (1, 2)]) == [plain[0], plain[2]]
