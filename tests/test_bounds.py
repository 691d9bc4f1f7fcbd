"""Resources bounded before they are spent: loader workers, processes, replica groups, vocabulary and class
counts and example shapes. A count no machine can hold is refused in one line (exit 2) before a run folder; a
large legal one is checked against the cores and memory there are, with a line when it is cut down. The cases
that would start processes or allocate run in a child held to a memory limit and a cap on process starts
(tests/guarded.py)."""

import os

import guarded
import pytest

from conftest import TINY_GPT, main
from ddplab.config import MAX_PROCESSES


def _physical() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@pytest.fixture
def no_processes(monkeypatch):
    """A refusal that came too late would start processes: fail the test instead."""
    from ddplab.commands import launch

    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args[0] if args else kwargs}")

    monkeypatch.setattr(launch.subprocess, "Popen", refuse)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["data.num_workers=100000000"], f"'data.num_workers' must be <= {MAX_PROCESSES}"),
        (
            ["--replica-groups", str(10**12)],
            f"--replica-groups {10**12} x --nproc-per-node 1 starts {10**12} processes",
        ),
        (["distributed.replica_groups=1000000000000"], f"'distributed.replica_groups' must be <= {MAX_PROCESSES}"),
        (["--nproc-per-node", "100000"], "--nproc-per-node 100000 starts 100000 processes on this machine"),
    ],
)
def test_a_count_no_machine_holds_is_refused_before_anything_starts(
    tmp_path, monkeypatch, capfd, no_processes, args, words
):
    monkeypatch.chdir(tmp_path)
    assert main("train", "distributed.fault_tolerance=replicas", *args) == 2
    err = capfd.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "experiments").exists()


def test_replica_groups_this_machine_cannot_hold_are_refused(tmp_path, monkeypatch, capfd, no_processes):
    groups = _physical() // (256 * 2**20) + 1  # one process more than its memory holds at 256 MiB each
    monkeypatch.chdir(tmp_path)
    assert main("train", "--replica-groups", str(groups), "distributed.fault_tolerance=replicas") == 2
    err = capfd.readouterr().err.strip()
    assert f"--replica-groups {groups} x --nproc-per-node 1 starts {groups} processes" in err, err
    assert len(err.splitlines()) == 1 and not (tmp_path / "experiments").exists()


def test_replica_groups_from_the_environment_are_bounded_too(monkeypatch, capfd):
    monkeypatch.setenv("NUM_REPLICA_GROUPS", str(10**12))
    assert main("train", "distributed.fault_tolerance=replicas") == 2
    assert f"NUM_REPLICA_GROUPS={10**12}: a job has 1 to {MAX_PROCESSES} replica groups" in capfd.readouterr().err


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["model.name=transformer", "data.name=synthetic_reviews", "data.vocab_size=1000000000000"], "data.vocab_size"),
        (["model.name=transformer", "data.name=synthetic_reviews", "data.max_len=1000000000"], "data.max_len"),
        (["model.name=cnn", "data.name=synthetic", "data.num_classes=1000000000000"], "data.num_classes"),
        (["model.name=cnn", "data.name=synthetic", "data.image_size=1000000"], "data.image_size"),
        (["model.name=gpt", "model.dim=10000000"], "model.dim"),
        (["model.name=gpt", "data.name=synthetic", "data.num_samples=1000000000000"], "data.num_samples"),
    ],
)
def test_counts_and_shapes_this_machine_cannot_hold_are_refused_before_a_run_folder(tmp_path, args, words):
    proc = guarded.run(0, "train", *args, "logging.trackers=[]", cwd=tmp_path)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"ddplab: error: {words}=") and "this machine has" in err and "needs" in err, err
    assert not (tmp_path / "experiments").exists()


def test_loader_workers_are_cut_to_four_a_core_with_a_line():
    from ddplab.engine.loop.loaders import _cores, bounded_workers

    workers, line = bounded_workers(100_000, 1)
    assert workers <= 4 * _cores() and line.startswith(f"data.num_workers=100000 cut to {workers} loader workers")
    assert bounded_workers(workers, 1) == (workers, None)  # what fits is kept, without a word
    assert bounded_workers(100_000, 10**6)[0] <= 4  # more processes on the node than cores: one core's share


def test_loader_workers_are_cut_to_what_memory_holds(monkeypatch):
    from ddplab.engine.loop import loaders

    sizes = {"MemAvailable": 3 * 2**30, "Private_Dirty": 2**30, "Private_Clean": 0}
    monkeypatch.setattr(loaders, "_meminfo", sizes.get)
    monkeypatch.setattr(loaders, "_cores", lambda: 64)
    workers, line = loaders.bounded_workers(16, 1)
    assert workers == 3 and "3.0 GiB of available memory" in line and "1024 MiB a worker" in line


def test_a_run_asking_for_100000_loader_workers_trains_with_what_the_machine_holds(tmp_path):
    cores = len(os.sched_getaffinity(0))
    args = ["train", *TINY_GPT, "training.max_steps=2", "data.num_workers=100000", "experiment.name=w"]
    proc = guarded.run(3 * 4 * cores + 2, *args, cwd=tmp_path)  # train, val and test loaders' workers, and 2 more
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = (tmp_path / "experiments" / "w" / "train.log").read_text()
    assert "data.num_workers=100000 cut to" in log and "data.num_workers=100000 cut to" in proc.stdout
