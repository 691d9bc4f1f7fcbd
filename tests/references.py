"""Reference runs trained once per test session and shared by the tests of several files (conftest.shared):
each is a finished job the tests read, or copy before they change it. Tests that compare a resumed run with
one of them train it with the same arguments (`args`), on a corpus of the same text (`corpus`)."""

from __future__ import annotations

from pathlib import Path

from conftest import TINY_GPT, assert_ok, ddplab, shared, torchrun

SAMPLES = 96  # 2 ranks x batch 8 -> 6 steps per epoch, 12 in all


def corpus(folder: Path, chars: int) -> Path:
    """The first `chars` characters of the embedded corpus, as a user's text file in `folder`."""
    from ddplab.workloads.char_lm import embedded_corpus

    path = folder / "corpus.txt"
    path.write_text(embedded_corpus()[:chars])
    return path


def gpt_args(corpus: Path, name: str) -> list[str]:
    """A 2-epoch GPT job with a snapshot every 2 steps and every step's loss logged."""
    return [
        "train",
        f"data.path={corpus}",
        *TINY_GPT,
        f"data.limit={SAMPLES}",
        "training.epochs=2",
        "checkpoint.every=2",
        "logging.log_every=1",
        "generate.max_new_tokens=0",
        "distributed.timeout=60",
        f"experiment.name={name}",
    ]


def _log(folder: Path, proc) -> None:
    """What the job printed, kept beside it for the tests that read it."""
    (folder / "stdout.txt").write_text(proc.stdout)
    (folder / "stderr.txt").write_text(proc.stderr)
    assert_ok(proc)


def torchrun_gpt() -> Path:
    """gpt_args on 20 kB of text under plain torchrun, 2 processes, never interrupted: its run folder (the
    job's output in stdout.txt and stderr.txt beside it)."""

    def make(folder: Path) -> None:
        # cold: its processes end through the interpreter's teardown, which test_ddp checks never aborts
        _log(folder, torchrun(2, *gpt_args(corpus(folder, 20_000), "ref"), cwd=folder, cold=True))

    return shared("torchrun-gpt", make) / "experiments" / "ref"


def launched_job(corpus: Path) -> list[str]:
    """20 steps of GPT (2 ranks x batch 8, 320 samples), every step logged."""
    return [
        f"data.path={corpus}",
        *TINY_GPT,
        "data.limit=320",
        "training.epochs=1",
        "logging.log_every=1",
        "generate.max_new_tokens=0",
        "distributed.timeout=60",
    ]


def launched_args(corpus: Path, name: str, *extra: str) -> list[str]:
    return ["train", *launched_job(corpus), f"experiment.name={name}", *extra]


def launched_gpt() -> Path:
    """launched_args on 40 kB of text, launched by `ddplab train --nproc-per-node 2`, never interrupted: its run
    folder."""

    def make(folder: Path) -> None:
        args = launched_args(corpus(folder, 40_000), "r")
        _log(folder, ddplab(args[0], "--nproc-per-node", "2", *args[1:], cwd=folder))

    return shared("launched-gpt", make) / "experiments" / "r"
