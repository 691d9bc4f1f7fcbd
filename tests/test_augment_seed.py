"""Random augmentation drawn from a per-sample seed (data.per_sample_seed, the default): a sample is augmented
the same whatever the world size, from torch's, Python's and numpy's generators alike; a 2-process and a
1-process run at the same global batch train on the same augmented samples; verify passes on a model with
dropout and random augmentation, and names BatchNorm with its remedy when only BatchNorm remains."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from conftest import assert_ok, main, verify
from conftest import ddplab as ddplab_cli
from ddplab.data.sample_seed import PerSampleSeed
from ddplab.data.sampler import ResumableDistributedSampler

JITTER = '''
import os
import random

import numpy as np
import torch
from torch.utils.data import Dataset

import ddplab


class RandomJitter:
    """Noise from all three generators a transform may draw from."""

    def __call__(self, x):
        return x + 0.5 * torch.rand(x.shape) + 0.2 * float(np.random.rand()) + 0.2 * random.random()


class Points(Dataset):
    """Item i: (i, its 4 features jittered), its target. The id travels as the first input column."""

    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 4, generator=g), torch.randn(n, generator=g)
        self.transform = RandomJitter()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return torch.cat([torch.tensor([float(i)]), self.transform(self.x[i])]), self.y[i]


def data(cfg):
    return ddplab.Data(train=Points(cfg.options.get("samples", 64)), val=Points(16), task=ddplab.Regression())


class Net(torch.nn.Module):
    """Dropout (or BatchNorm) between two layers. In training, each batch's rows are appended to
    model.options.record/<pid>.txt as they reached the model: the id, then the augmented features."""

    def __init__(self, cfg, normed):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)
        self.mid = torch.nn.BatchNorm1d(8) if normed else torch.nn.Dropout(0.3)
        self.record = cfg.options.get("record")

    def forward(self, x):
        if self.record and self.training and torch.is_grad_enabled():
            with open(f"{self.record}/{os.getpid()}.txt", "a") as f:
                f.writelines(" ".join(repr(v) for v in row) + "\\n" for row in x.tolist())
        return self.head(self.mid(torch.tanh(self.body(x[:, 1:])))).squeeze(-1)


def model(cfg, data):
    return Net(cfg, normed=False)


def normed(cfg, data):
    return Net(cfg, normed=True)
'''


def _workload(tmp_path, model: str = "model") -> list[str]:
    workload = tmp_path / "jitter.py"
    workload.write_text(JITTER)
    return [
        f"data.name={workload}:data",
        f"model.name={workload}:{model}",
        "logging.trackers=[]",
        "logging.progress=false",
        f"experiment.output_dir={tmp_path / 'runs'}",
    ]


class Noisy(Dataset):
    """Sample i is i plus noise drawn from torch's global generator, Python's `random` or numpy's."""

    def __init__(self, source: str = "torch") -> None:
        self.source = source

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int):
        if self.source == "random":
            noise = torch.tensor([random.random() for _ in range(3)])
        elif self.source == "numpy":  # one normal: numpy keeps the pair's other one cached, for the next item
            noise = torch.from_numpy(np.random.rand(3) + 0.1 * np.random.standard_normal()).float()
        else:
            noise = torch.rand(3)
        return torch.full((3,), float(i)) + noise, i


def _seen(world: int, epoch: int, source: str = "torch", seed: int = 7) -> dict[int, torch.Tensor]:
    """Sample id -> the augmented tensor, over every rank of a `world`-process epoch (batch 2 per rank)."""
    seen = {}
    for rank in range(world):
        sampler = ResumableDistributedSampler(Noisy(source), world, rank, shuffle=True, seed=seed)
        sampler.keyed = True
        sampler.set_epoch(epoch)
        torch.manual_seed(100 + rank)  # each rank's own streams, as in training
        random.seed(100 + rank)
        np.random.seed(100 + rank)
        loader = torch.utils.data.DataLoader(PerSampleSeed(Noisy(source), seed), batch_size=2, sampler=sampler)
        for x, ids in loader:
            seen.update(zip(ids.tolist(), x, strict=True))
    return seen


@pytest.mark.parametrize("source", ["torch", "random", "numpy"])
def test_one_and_two_processes_see_the_same_augmented_samples(source):
    assert PerSampleSeed(Noisy(source), 0).seeded == ["torch"] + ([source] if source != "torch" else [])
    one, two = _seen(1, epoch=3, source=source), _seen(2, epoch=3, source=source)
    assert sorted(one) == sorted(two) == list(range(20))
    for i in one:
        assert torch.equal(one[i], two[i]), i
    noise = torch.stack([one[i] - i for i in sorted(one)])
    assert noise.std() > 0.1  # the augmentation draws: not the same noise everywhere
    other = _seen(1, epoch=4, source=source)
    assert not any(torch.equal(one[i], other[i]) for i in one)  # a new epoch, new draws


def _draws():
    return torch.rand(4).tolist(), random.random(), random.gauss(), float(np.random.rand()), np.random.randn(3).tolist()


def _reseed(cached: bool):
    """The caller's streams; `cached`: numpy and Python each hold the second normal of a pair they drew."""
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    if cached:
        random.gauss(), np.random.standard_normal()


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("source", ["torch", "random", "numpy"])
def test_reading_leaves_the_callers_random_streams_as_they_were(source, cached):
    seeded = PerSampleSeed(Noisy(source), 0)
    _reseed(cached)
    expected = _draws()
    _reseed(cached)
    seeded[(0, 5)], seeded.__getitems__([(0, 1), (0, 2)])
    assert _draws() == expected
    assert torch.equal(seeded[(2, 5)][0], seeded[(2, 5)][0])  # the same sample and epoch, the same draws


def _records(folder) -> dict[int, list[tuple]]:
    """Sample id -> the augmented features it reached the model with, every time, over every process."""
    seen = {}
    for path in folder.glob("*.txt"):
        for line in path.read_text().splitlines():
            i, *features = map(float, line.split())
            seen.setdefault(int(i), []).append(tuple(features))
    return {i: sorted(v) for i, v in seen.items()}


def test_a_two_process_and_a_one_process_run_train_on_the_same_augmented_samples(tmp_path, monkeypatch, capfd):
    """The same global batch of 8, two epochs of 32 samples: every sample reaches the model twice, with
    the same augmented features in both runs, and different ones in its two epochs."""
    seen = {}
    for nproc, batch in ((2, 4), (1, 8)):
        record = tmp_path / f"record{nproc}"
        record.mkdir()
        args = [
            "train",
            *_workload(tmp_path),
            "data.options.samples=32",
            f"model.options.record={record}",
            f"training.batch_size={batch}",
            "training.epochs=2",
            f"experiment.name=n{nproc}",
        ]
        if nproc == 2:
            assert_ok(ddplab_cli(args[0], "--nproc-per-node", "2", *args[1:], cwd=tmp_path))
        else:  # one process: this one (a process adds nothing)
            monkeypatch.chdir(tmp_path)
            assert main(*args) == 0, capfd.readouterr().err[-3000:]
        seen[nproc] = _records(record)
    assert len(list((tmp_path / "record2").glob("*.txt"))) == 2  # both processes trained
    assert sorted(seen[1]) == list(range(32)) and seen[2] == seen[1]
    assert all(len(set(v)) == 2 for v in seen[1].values())  # a new epoch, new draws


def test_verify_passes_with_dropout_and_random_augmentation(tmp_path):
    proc = verify("--nproc", "2", *_workload(tmp_path), "training.batch_size=4", "training.max_steps=6", cwd=tmp_path)
    assert_ok(proc)
    assert "randomness: dropout off in both runs; augmentation drawn from per-sample seeds" in proc.stdout
    assert "random transforms on the training set (RandomJitter) drawn from per-sample seeds" in proc.stdout
    assert "PASS" in proc.stdout, proc.stdout


def test_verify_names_batchnorm_with_its_remedy_when_only_it_remains(tmp_path):
    proc = verify(
        "--nproc",
        "2",
        *_workload(tmp_path, "normed"),
        "training.batch_size=4",
        "training.max_steps=6",
        cwd=tmp_path,
    )
    assert proc.returncode == 1 and "FAIL (see the randomness named above)" in proc.stdout, proc.stdout
    named = [line for line in proc.stdout.splitlines() if line.startswith("randomness:")]
    remaining = [line for line in named if "BatchNorm" in line]
    assert len(remaining) == 1 and "each of the 2 processes normalises its own 4 samples" in remaining[0]
    assert "distributed.sync_batchnorm=true" in remaining[0] and "GroupNorm" in remaining[0]
    assert "(RandomJitter) drawn from per-sample seeds: the same draws in both runs" in proc.stdout
    assert not any("each process draws its own" in line or "still drawing" in line for line in named), named


def test_datasets_that_fetch_whole_batches_keep_doing_so_unless_they_transform():
    datasets = pytest.importorskip("datasets")
    plain = datasets.Dataset.from_dict({"x": [1.0, 2.0, 3.0], "label": [0, 1, 0]})
    assert PerSampleSeed(plain, 0).whole_batches and PerSampleSeed(plain, 0).seeded == []
    assert not PerSampleSeed(plain.with_transform(lambda b: b), 0).whole_batches  # may draw: item by item
    assert not PerSampleSeed(Noisy(), 0).whole_batches
    assert PerSampleSeed(plain, 0).__getitems__([(1, 0), (1, 2)]) == [plain[0], plain[2]]
