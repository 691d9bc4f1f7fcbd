"""Peak memory per rank with text tokenised into HF's memory-mapped Arrow cache, against token lists
held in memory.

    python benchmarks/text_cache_memory.py [--rows 1000000] [--nproc 2] [--cache-dir DIR]

Cache: `torchrun --nproc-per-node=N` workers each call ddplab's own data builder for
`synthetic_reviews` (rank 0 generates the reviews with `Dataset.from_generator` and tokenises them
with `Dataset.map` into the Arrow cache while the others wait; a second run finds both built), then
read their whole shard of one epoch through a DataLoader, as training does. Baseline: one process
tokenises the same rows into Python lists of ids, as a loader without a cache would on every rank.
Printed per process: peak RSS (ru_maxrss) and, at the end, private (RssAnon) and file-backed
(RssFile) resident memory: memory-mapped cache pages are file-backed, shared between ranks and
dropped by the kernel under pressure.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path


def memory() -> dict:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    mb = lambda key: int(status.get(key, "0 kB").split()[0]) / 1024  # noqa: E731
    return {
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_anon_mb": mb("RssAnon"),
        "rss_file_mb": mb("RssFile"),
    }


def worker(a) -> None:
    from torch.utils.data import DataLoader, DistributedSampler

    from ddplab.engine.loop.setup import build_data
    from ddplab.engine.parallel import distributed
    from ddplab.registry import load_config, workload

    cfg = load_config(
        None,
        [
            "model.name=transformer",
            "data.name=synthetic_reviews",
            f"data.num_samples={a.rows}",
            f"data.max_len={a.max_len}",
            f"data.cache_dir={a.cache_dir}",
            "data.val_fraction=0.01",
        ],
    )
    with distributed.session("gloo") as ctx:
        before = memory()
        start = time.perf_counter()
        bundle = build_data(cfg, ctx, workload(cfg))
        built = time.perf_counter() - start
        loader = DataLoader(
            bundle.train,
            batch_size=64,
            collate_fn=bundle.collate_fn,
            sampler=DistributedSampler(bundle.train, ctx.world_size, ctx.rank, seed=0),
        )
        start, tokens = time.perf_counter(), 0
        for batch in loader:
            tokens += int(batch["attention_mask"].sum())
        read = time.perf_counter() - start
        result = {
            "rank": ctx.rank,
            "data_s": built,
            "epoch_read_s": read,
            "tokens": tokens,
            "after_imports": before,
            "end": memory(),
        }
        for line in ctx.gather_objects(json.dumps(result)):
            if ctx.is_main:
                print("RESULT " + line, flush=True)


def baseline(a) -> None:
    import torch  # noqa: F401 - the same imports as a training process, for a fair floor

    from ddplab.data.text_sources import generate
    from ddplab.workloads.text_classification import HashTokenizer

    before = memory()
    tok = HashTokenizer(30_000, a.max_len)
    ids, labels = [], []
    start = time.perf_counter()
    for lo in range(0, a.rows, 10_000):
        texts, y = generate(1337, lo, min(10_000, a.rows - lo), 2)
        ids += [tok.encode(t) for t in texts]
        labels += y.tolist()
    print(
        "RESULT "
        + json.dumps(
            {
                "rank": "lists",
                "data_s": time.perf_counter() - start,
                "tokens": sum(map(len, ids)),
                "after_imports": before,
                "end": memory(),
            }
        ),
        flush=True,
    )


def run(cmd: list[str]) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode:
        sys.exit(out.stderr[-3000:])
    return [json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--cache-dir", default="/tmp/ddplab-bench-cache")
    p.add_argument("--role", choices=("main", "worker", "baseline"), default="main")
    a = p.parse_args()
    if a.role != "main":
        return worker(a) if a.role == "worker" else baseline(a)
    me = [sys.argv[0], f"--rows={a.rows}", f"--max-len={a.max_len}", f"--cache-dir={a.cache_dir}"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}"]
    rows = [("lists", r) for r in run([sys.executable, *me, "--role=baseline"])]
    rows += [
        ("cache, first run" if i == 0 else "cache, built", r)
        for i in range(2)
        for r in run([*torchrun, *me, "--role=worker"])
    ]
    base = rows[0][1]["end"]["peak_rss_mb"]
    print(f"{a.rows:,} synthetic reviews, max_len {a.max_len}, {a.nproc} ranks; memory in MiB")
    print(
        f"{'how':18s} {'rank':>5s} {'imports':>8s} {'peak RSS':>9s} {'anon':>7s} {'file':>7s} {'data s':>7s} "
        f"{'vs lists':>9s}"
    )
    for how, r in rows:
        e = r["end"]
        print(
            f"{how:18s} {str(r['rank']):>5s} {r['after_imports']['peak_rss_mb']:8.0f} {e['peak_rss_mb']:9.0f} "
            f"{e['rss_anon_mb']:7.0f} {e['rss_file_mb']:7.0f} {r['data_s']:7.1f} {e['peak_rss_mb'] / base:8.2f}x"
        )


if __name__ == "__main__":
    main()
