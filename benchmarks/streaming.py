"""Streaming from shards (ddplab.Shards): memory, throughput and resume, printed as ratios.

A Parquet set of (text, label) rows made locally (--rows, issue 35's 5 M by default), a tiny
bag-of-words classifier trained by ddplab.train in this process, one rank, batches of 64:

- memory: resident set size at step 3,000 against step 100 of a streamed run (target <= 1.10x);
- throughput: steps 100 to 3,000 streamed from the shards against the same rows held in memory
  (the first --memory-rows rows, a map-style dataset; target >= 0.9x);
- resume: 90 % into a streamed epoch of --resume-rows rows, the time from asking for the epoch
  (data.stream.Stream at `consumed`, a DataLoader) to its first batch, against a fresh epoch's
  (target <= 1.2x); beside it the skip-forward path of a stream without state, which reads and
  drops the 90 %.

    python benchmarks/streaming.py [--rows 5000000] [--steps 3000] [--memory-rows 200000]
                                   [--resume-rows 500000] [--repeat 3] [--root /tmp/ddplab-streaming]
"""

from __future__ import annotations

import argparse
import os
import statistics
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


def data(cfg):
    o = cfg.options
    if o.kind == "memory":
        import pyarrow.dataset as pds

        rows = pds.dataset(sorted(Path(o.path).glob("*.parquet")), format="parquet").head(o.rows).to_pylist()
        return ddplab.Data(train=InMemory(rows), task=ddplab.Classification(2))
    return ddplab.Data(train=ddplab.Shards(o.path, seed=0, transform=encode), task=ddplab.Classification(2))


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
    """The clock and the resident set size at steps `first` and `last`."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last, self.at = first, last, {}

    def on_step_end(self, view) -> None:
        if view.step in (self.first, self.last):
            self.at[view.step] = (time.perf_counter(), rss_bytes())


def train(kind: str, path: Path, rows: int, steps: int, root: Path) -> Probe:
    probe = Probe(100, steps)
    ddplab.train(
        None,
        [
            f"data.options.kind={kind}",
            f"data.options.path={path}",
            f"data.options.rows={rows}",
            f"training.max_steps={steps}",
            "training.epochs=1",
            "training.batch_size=64",
            "training.warmup_steps=0",
            "logging.trackers=[]",
            "logging.progress=false",
            "logging.log_every=500",
            "checkpoint.save_best=false",
            "logging.plots=false",
            f"experiment.name={kind}",
            f"experiment.output_dir={root / 'runs'}",
        ],
        model=model,
        data=data,
        callbacks=[probe],
    )
    return probe


class Plain(torch.utils.data.IterableDataset):
    """The same stream without seeking or state: a resumed epoch reads and drops what was consumed."""

    def __init__(self, shards) -> None:
        self.shards = shards

    def __iter__(self):
        return iter(self.shards)


def first_batch_seconds(dataset, consumed: int) -> float:
    from ddplab.data.stream import Stream

    t0 = time.perf_counter()
    stream = Stream(dataset, rank=0, world_size=1, batch_size=64)
    stream.set_epoch(1, consumed)
    next(iter(torch.utils.data.DataLoader(stream, batch_size=64)))
    return time.perf_counter() - t0


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=5_000_000, help="rows of the streamed set")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--memory-rows", type=int, default=200_000, help="rows held in memory for the throughput baseline")
    p.add_argument("--resume-rows", type=int, default=500_000, help="rows of the epoch resumed at 90 %%")
    p.add_argument("--repeat", type=int, default=3, help="alternating runs of each kind")
    p.add_argument("--root", type=Path, default=Path("/tmp/ddplab-streaming"))
    a = p.parse_args()

    t0 = time.perf_counter()
    big = make_set(a.root / f"rows-{a.rows}", a.rows)
    small = make_set(a.root / f"rows-{a.resume_rows}", a.resume_rows)
    print(f"sets made or found in {time.perf_counter() - t0:.0f} s; load average {os.getloadavg()[0]:.1f}")

    growth, speed = [], []
    for r in range(a.repeat):
        runs = {}
        for kind in ("stream", "memory") if r % 2 == 0 else ("memory", "stream"):
            probe = train(kind, big, a.memory_rows, a.steps, a.root / f"try{r}")
            (t1, m1), (t2, m2) = probe.at[100], probe.at[a.steps]
            runs[kind] = (a.steps - 100) / (t2 - t1)
            if kind == "stream":
                growth.append(m2 / m1)
        speed.append(runs["stream"] / runs["memory"])
        print(
            f"run {r + 1}: streamed {runs['stream']:.0f} steps/s, in memory {runs['memory']:.0f} steps/s, "
            f"memory at step {a.steps} / step 100 {growth[-1]:.3f}"
        )

    shards = ddplab.Shards(small, seed=0)
    at = int(len(shards) * 0.9) // 64 * 64
    fresh, seek, skip = [], [], []
    for _ in range(a.repeat):
        fresh.append(first_batch_seconds(shards, 0))
        seek.append(first_batch_seconds(shards, at))
        skip.append(first_batch_seconds(Plain(shards), at))
    print(
        f"first batch of an epoch of {len(shards):,} rows (s): fresh {spread(fresh)}, resumed at {at:,} by seeking "
        f"{spread(seek)}, by skipping forward {spread(skip)}"
    )

    print(
        f"\nissue 35 figures, {a.rows:,} rows, {a.steps} steps, median of {a.repeat} (range); "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print(f"  memory, step {a.steps} / step 100:          {spread(growth)}x  (target <= 1.10)")
    print(f"  throughput, streamed / in memory:      {spread(speed)}x  (target >= 0.90)")
    print(
        f"  resume at 90 %, seek / fresh start:     {spread([s / f for s, f in zip(seek, fresh, strict=True)])}x  "
        f"(target <= 1.20)"
    )
    print(f"  resume at 90 %, skip forward / fresh:   {spread([s / f for s, f in zip(skip, fresh, strict=True)])}x")


if __name__ == "__main__":
    main()
