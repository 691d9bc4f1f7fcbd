"""Streaming from shards (ddplab.Shards): memory, throughput and resume, printed as ratios.

A Parquet set of (text, label) rows made locally (--rows, issue 35's 5 M by default), a tiny
bag-of-words classifier trained by ddplab.train in this process, one rank, batches of 64:

- memory: resident set size at step 3,000 against step 100 of a streamed run (target <= 1.10x);
- throughput: steps 100 to 3,000 streamed from the shards against the same rows held in memory
  (the first --memory-rows rows, a map-style dataset; target >= 0.9x);
- resume: a snapshot 90 % into a streamed epoch of --resume-rows rows, resumed: the time from
  starting a Python process that calls ddplab.train() to the end of the first step, against a fresh
  run's (target <= 1.2x; also printed from ddplab.train() in this process, imports done); beside it
  the same snapshot resumed with the stream wrapped so that it cannot seek (a stream without state,
  which ddplab reads forward past the 90 %).

    python benchmarks/streaming.py [--rows 5000000] [--steps 3000] [--memory-rows 200000]
                                   [--resume-rows 500000] [--repeat 3] [--root /tmp/ddplab-streaming]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import ddplab

WORDS = (
    "good great fine nice superb lovely bad awful poor sad dull worse the a film plot was very it and of to "
    "actor scene story music end long short"
).split()
LENGTH = 16  # words a text is cut or padded to
SHARD_ROWS = 250_000


def make_set(folder: Path, rows: int) -> Path:
    """`rows` reviews of 4 to 15 words in Parquet shards of 250 k rows; the label says whether more
    of the first 6 words (positive) than of the next 6 (negative) are in it. Made once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if (folder / ".done").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    words = np.array(WORDS, dtype=object)
    for k, first in enumerate(range(0, rows, SHARD_ROWS)):
        n = min(SHARD_ROWS, rows - first)
        ids = rng.integers(0, len(WORDS), (n, 15))
        lengths = rng.integers(4, 16, n)
        mood = ((ids < 6) & (np.arange(15) < lengths[:, None])).sum(1) - (
            (ids >= 6) & (ids < 12) & (np.arange(15) < lengths[:, None])
        ).sum(1)
        texts = [" ".join(words[row[:m]]) for row, m in zip(ids, lengths, strict=True)]
        table = pa.table({"text": texts, "label": (mood > 0).astype(np.int64)})
        pq.write_table(table, folder / f"{k:04}.parquet", row_group_size=25_000)
    (folder / ".done").touch()
    return folder


VOCAB = {w: i + 1 for i, w in enumerate(WORDS)}


def encode(row: dict) -> dict:
    """A row as the model's inputs: word ids padded with 0 to LENGTH, and its label."""
    ids = [VOCAB.get(w, 0) for w in row["text"].split()[:LENGTH]]
    return {"ids": torch.tensor(ids + [0] * (LENGTH - len(ids))), "labels": row["label"]}


class InMemory(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return encode(self.rows[i])


SKIP_FORWARD = False  # set by first_step(): the stream is read without seeking (a resumed run reads and drops)
LAST_FIRST = 0.0  # the wall clock at the end of the last first_step()'s first step


class Plain(torch.utils.data.IterableDataset):
    """The same stream without seeking or state: a resumed epoch reads and drops what was consumed."""

    def __init__(self, shards) -> None:
        self.shards = shards

    def set_epoch(self, epoch: int) -> None:
        self.shards.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.shards)

    def __iter__(self):
        return iter(self.shards)


def data(cfg):
    o = cfg.options
    if o.kind == "memory":
        import pyarrow.dataset as pds

        rows = pds.dataset(sorted(Path(o.path).glob("*.parquet")), format="parquet").head(o.rows).to_pylist()
        return ddplab.Data(train=InMemory(rows), task=ddplab.Classification(2))
    shards = ddplab.Shards(o.path, seed=0, transform=encode)
    return ddplab.Data(train=Plain(shards) if SKIP_FORWARD else shards, task=ddplab.Classification(2))


class Bag(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.EmbeddingBag(len(WORDS) + 1, 32, padding_idx=0)
        self.out = torch.nn.Linear(32, 2)

    def forward(self, ids, labels=None):
        return self.out(self.embed(ids))


def model(cfg, data):
    torch.manual_seed(0)
    return Bag()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Probe(ddplab.Callback):
    """The clock and the resident set size at the end of the steps asked for, and the clock at the end of
    the first step taken; at step `preempt`, the SIGUSR1 of a pre-emption (the run snapshots and stops)."""

    def __init__(self, *steps: int, preempt: int | None = None) -> None:
        self.steps, self.preempt, self.at, self.first = steps, preempt, {}, None

    def on_step_end(self, view) -> None:
        self.first = self.first or time.time()  # a wall clock: compared with the parent's in a new process
        if view.step in self.steps:
            self.at[view.step] = (time.perf_counter(), rss_bytes())
        if view.step == self.preempt:
            os.kill(os.getpid(), signal.SIGUSR1)


def train(kind: str, path: Path, steps: int, root: Path, name: str, probe: Probe, rows: int = 0) -> None:
    options = [f"data.options.kind={kind}", f"data.options.path={path}", f"data.options.rows={rows}"]
    run = [f"training.max_steps={steps}", "training.epochs=1", "training.batch_size=64", "training.warmup_steps=0"]
    quiet = ["logging.trackers=[]", "logging.progress=false", "logging.log_every=100", "logging.plots=false"]
    where = ["checkpoint.save_best=false", f"experiment.output_dir={root}", f"experiment.name={name}"]
    ddplab.train(None, options + run + quiet + where, model=model, data=data, callbacks=[probe])


def first_step(how: str, path: Path, steps: int, root: Path, name: str, preempt: int, new_process: bool) -> float:
    """Seconds from asking for the run (here, or by starting a Python process) to the end of its first step:
    a fresh run ("fresh") or the snapshot in root/name resumed by seeking ("seek") or skipping forward
    ("skip"), or the same rows held in memory resumed by the sampler ("map", what any resume costs)."""
    global SKIP_FORWARD, LAST_FIRST
    t0 = time.time()
    if new_process:
        code = (
            f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import streaming as s; "
            f"s.first_step({how!r}, s.Path({str(path)!r}), {steps}, s.Path({str(root)!r}), {name!r}, "
            f"{preempt}, False); print('first step at', s.LAST_FIRST)"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        return float(out.rsplit("first step at", 1)[1]) - t0
    SKIP_FORWARD = how == "skip"
    probe = Probe(preempt=preempt)
    if how == "map":
        train("memory", path, steps, root, name, probe, steps * 64)
    else:
        train("stream", path, steps, root, name, probe)
    SKIP_FORWARD = False
    LAST_FIRST = probe.first
    return probe.first - t0


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=5_000_000, help="rows of the streamed set")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--memory-rows", type=int, default=200_000, help="rows held in memory for the throughput baseline")
    p.add_argument("--resume-rows", type=int, default=500_000, help="rows of the epoch resumed at 90 %%")
    p.add_argument("--repeat", type=int, default=3, help="alternating runs of each kind")
    p.add_argument("--resume-only", action="store_true", help="only the resume figures")
    p.add_argument("--root", type=Path, default=Path("/tmp/ddplab-streaming"))
    a = p.parse_args()

    t0 = time.perf_counter()
    big = make_set(a.root / f"rows-{a.rows}", a.rows)
    small = make_set(a.root / f"rows-{a.resume_rows}", a.resume_rows)
    runs = a.root / f"runs-{time.time():.0f}"
    print(f"sets made or found in {time.perf_counter() - t0:.0f} s; load average {os.getloadavg()[0]:.1f}")

    growth, speed = [], []
    for r in range(0 if a.resume_only else a.repeat):
        rate = {}
        for kind in ("stream", "memory") if r % 2 == 0 else ("memory", "stream"):
            probe = Probe(100, a.steps)
            train(kind, big, a.steps, runs, f"{kind}{r}", probe, a.memory_rows)
            (t1, m1), (t2, m2) = probe.at[100], probe.at[a.steps]
            rate[kind] = (a.steps - 100) / (t2 - t1)
            if kind == "stream":
                growth.append(m2 / m1)
        speed.append(rate["stream"] / rate["memory"])
        print(
            f"run {r + 1}: streamed {rate['stream']:.0f} steps/s, in memory {rate['memory']:.0f} steps/s, "
            f"resident memory at step {a.steps} / step 100 {growth[-1]:.3f}"
        )

    # A snapshot 90 % into the epoch, then alternating: a fresh run, the snapshot resumed by seeking, and
    # resumed by skipping forward; each timed from ddplab.train() to the end of its first step.
    steps = a.resume_rows // 64
    at = int(steps * 0.9) // 100 * 100  # a stop signal is acted on at a log interval (logging.log_every=100)
    t0 = time.perf_counter()
    train("stream", small, steps, runs, "base", Probe(preempt=at))
    train("memory", small, steps, runs, "base_map", Probe(preempt=at), steps * 64)
    print(
        f"a snapshot {at} steps ({at * 64:,} rows) into an epoch of {a.resume_rows:,} rows made in "
        f"{time.perf_counter() - t0:.0f} s"
    )
    warm = {"fresh": [], "seek": [], "skip": [], "map": []}
    cold = {"fresh": [], "seek": [], "skip": [], "map": []}
    for r in range(a.repeat):
        for how in ("fresh", "seek", "skip", "map"):
            for where, out in (("new", cold), ("here", warm)):
                name = f"{how}{r}{where}"
                if how != "fresh":
                    shutil.copytree(runs / ("base_map" if how == "map" else "base"), runs / name)
                preempt = 1 if how == "fresh" else at + 1  # it stops at the next log interval
                out[how].append(first_step(how, small, steps, runs, name, preempt, where == "new"))
    for label, times in (("a new process", cold), ("this process (imports done)", warm)):
        print(
            f"start to the end of the first step in {label} (s): "
            + ", ".join(f"{k} {spread(v)}" for k, v in times.items())
        )

    print(
        f"\nissue 35 figures, {a.rows:,} rows, {a.steps} steps, median of {a.repeat} (range); "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    if not a.resume_only:
        print(f"  resident memory, step {a.steps} / step 100:  {spread(growth)}x  (target <= 1.10)")
        print(f"  throughput, streamed / in memory:        {spread(speed)}x  (target >= 0.90)")
    for label, times in (("", cold), (" (in this process)", warm)):
        ratio = {k: [x / f for x, f in zip(times[k], times["fresh"], strict=True)] for k in ("seek", "skip", "map")}
        print(
            f"  resume at 90 %, seek / fresh start{label}:  {spread(ratio['seek'])}x"
            + ("" if label else "  (target <= 1.20)")
        )
        print(f"  resume at 90 %, skip forward / fresh{label}:  {spread(ratio['skip'])}x")
        print(f"  resume at 90 %, the rows in memory / fresh{label}:  {spread(ratio['map'])}x")


if __name__ == "__main__":
    main()
