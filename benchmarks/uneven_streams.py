"""Streams of uneven length across ranks: what counting the samples they leave untrained costs, printed as ratios.

Each rank's epoch ends when the first rank's stream does (one all-reduce of a count a step, as before). What the
longer ranks still hold is now read to its end and counted (StreamFeed.next_step, metrics.csv untrained_samples),
and every batch comes tagged with its loader worker and size (a stream that shards itself is resumed from each
worker's own count, its batches put in the loader's turn). This times the training feed alone, no model, on 2
gloo processes, against today's agreed-count path before that change (the loop below, `today`), alternating:

- per step: the steps of an epoch but its last (the feed's own work and the all-reduce);
- per epoch: the whole epoch, the longer rank's leftovers read and the counts' all-reduce included.

A self-sharding stream of --items small items on rank 0 and --items x (1 + --extra) on rank 1, batches of 8, with
0 and 2 loader workers a rank.

    python benchmarks/uneven_streams.py [--items 4000] [--extra 0.25] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from itertools import islice

import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, IterableDataset, default_collate

BATCH = 8


class Uneven(IterableDataset):
    """Shards itself: rank r yields items * (1 + extra * r) small dicts."""

    shards_itself = True

    def __init__(self, items: int, extra: float, rank: int) -> None:
        self.items, self.extra, self.rank = items, extra, rank  # read in the rank: loader workers have no group

    def __iter__(self):
        rank = self.rank
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(worker, int(self.items * (1 + self.extra * rank)), workers):
            yield {"x": torch.full((4,), float(i)), "labels": i % 2}


def today(ctx, loader) -> tuple[int, float, float]:
    """The agreed-count path before this change: (steps, seconds of all steps but the last, of the epoch)."""
    began = time.perf_counter()
    batches, steps, last = iter(loader), 0, began
    while True:
        micro = list(islice(batches, 1))
        agreed = int(ctx.all_reduce(torch.tensor([float(len(micro))]), "min").item())
        if not micro[:agreed]:
            break
        steps, last = steps + 1, time.perf_counter()
    return steps, last - began, time.perf_counter() - began


def counted(feed) -> tuple[int, float, float, tuple[int, int]]:
    """ddplab's StreamFeed: the same, and the epoch's counts (read, untrained) all-reduced at its end."""
    began = time.perf_counter()
    batches, steps, last = feed.epoch(0, 0), 0, began
    while feed.next_step(batches, 1):
        steps, last = steps + 1, time.perf_counter()
    counts = feed.read()
    return steps, last - began, time.perf_counter() - began, counts


def rank_main(rank: int, port: int, args, out) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1"
    )
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    from ddplab.config.reading import read_config
    from ddplab.data.stream import Stream
    from ddplab.engine.loop.loaders import Loaders, train_feed
    from ddplab.engine.parallel import distributed

    with distributed.session("gloo") as ctx:
        dataset = Uneven(args.items, args.extra, rank)
        for workers in (0, 2):
            cfg = read_config(None, [f"training.batch_size={BATCH}", f"data.num_workers={workers}"])
            loaders = Loaders(cfg.data, ctx, None, BATCH, cfg.experiment.seed)
            feed = train_feed(dataset, loaders, cfg.data, ctx, lambda line: None, (rank, 2))
            plain = DataLoader(
                Stream(dataset, rank, 2, BATCH), batch_size=BATCH, num_workers=workers, collate_fn=default_collate
            )
            times: dict[str, list] = {"today": [], "counted": []}
            for _ in range(args.repeat):
                for name in ("today", "counted"):
                    ctx.barrier()
                    times[name].append(today(ctx, plain) if name == "today" else counted(feed))
            if rank == 0:
                out.put((workers, times))
            feed.loaders.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=4000)
    parser.add_argument("--extra", type=float, default=0.25)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = [out.get() for _ in range(2)]  # rank 0's, one per worker count
    for p in procs:
        p.join()
    print(f"load average {os.getloadavg()[0]:.1f}; {args.items} items on rank 0, x{1 + args.extra} on rank 1")
    print("| loader workers | steps | per step: counted / today | per epoch: counted / today | today ms/step |")
    print("|---|---|---|---|---|")
    for workers, times in sorted(results, key=lambda r: r[0]):
        steps, (read, untrained) = times["today"][0][0], times["counted"][-1][3]
        assert all(t[0] == steps for t in times["today"] + times["counted"])
        pairs = list(zip(times["counted"], times["today"], strict=True))
        step = sorted(c[1] / t[1] for c, t in pairs)
        epoch = sorted(c[2] / t[2] for c, t in pairs)
        ms = 1000 * statistics.median(t[1] / (steps - 1) for t in times["today"])
        print(
            f"| {workers} | {steps} ({untrained} of {read} samples untrained) | {statistics.median(step):.3f} "
            f"({step[0]:.3f}-{step[-1]:.3f}) | {statistics.median(epoch):.3f} ({epoch[0]:.3f}-{epoch[-1]:.3f}) "
            f"| {ms:.3f} |"
        )


if __name__ == "__main__":
    main()
