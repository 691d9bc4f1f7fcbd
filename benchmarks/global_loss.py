"""The loss averaged over the global count of the items it is a mean over (tokens, padding and -100 left out)
against the per-process average it replaced: the per-step cost of each, as a ratio.

Two workloads whose loss is a mean over tokens: the built-in char GPT, and a padded text task (a T5 from a
config on sequences of 4 to 32 tokens, labels padded with -100, so each batch's count of scored tokens
differs). Each is trained by this checkout's ddplab and by an older checkout's (`--before SRC`, the code
before the change), alternating in fresh `ddplab train --nproc-per-node N` commands. A step's cost is an
epoch's training time (evaluation and snapshots left out) over its steps, median over epochs 2+; the ratio
is taken within each round and its median and range printed.

    git archive <commit before the change> src | tar -x -C /tmp/old
    python benchmarks/global_loss.py --before /tmp/old/src [--nproc 2] [--rounds 3]

This file is also the padded text task's workload (`data.name=benchmarks/global_loss.py:seq2seq`).
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
VOCAB = 64  # 0 pads, 1 ends a sequence

WORKLOADS = {
    "char_gpt": ["model.name=gpt", "data.name=text", "model.layers=2", "model.dim=64", "model.heads=4"]
    + ["model.context=64", "training.batch_size=16", "data.limit=1024"],
    "padded_t5": [f"model.name={HERE}:t5", f"data.name={HERE}:seq2seq", "training.batch_size=16"],
}


def seq2seq(cfg):
    import ddplab

    rng = random.Random(0)

    def item():
        source = torch.tensor([rng.randrange(2, VOCAB) for _ in range(rng.randrange(4, 32))] + [1])
        return {"input_ids": source, "labels": source.flip(0)}  # the end token first: a task, not a copy

    def collate(items):
        pad = torch.nn.utils.rnn.pad_sequence
        ids = [i["input_ids"] for i in items]
        return {
            "input_ids": pad(ids, batch_first=True),
            "attention_mask": pad([torch.ones_like(i) for i in ids], batch_first=True),
            "labels": pad([i["labels"] for i in items], batch_first=True, padding_value=-100),
        }

    items = [item() for _ in range(640)]
    return ddplab.Data(train=Items(items[:512]), val=Items(items[512:]), task=ddplab.Task(), collate_fn=collate)


class Items(torch.utils.data.Dataset):
    def __init__(self, items: list) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


def t5(cfg, data):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    config.update({"dropout_rate": 0.0, "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0})
    return T5ForConditionalGeneration(config)


def step_seconds(src: str, overrides: list[str], nproc: int, epochs: int) -> float:
    """The median training time a step over epochs 2+ of one fresh run."""
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "ddplab", "train", "--nproc-per-node", str(nproc), *overrides]
        cmd += [f"training.epochs={epochs}", "training.warmup_steps=0", "logging.trackers=[]"]
        cmd += ["logging.progress=false", f"experiment.output_dir={out}", "experiment.name=b"]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{' '.join(cmd)}\n{done.stderr[-2000:]}")
        rows = list(csv.DictReader(open(Path(out) / "b" / "metrics.csv")))
    per_step, last = [], 0
    for row in rows:
        steps, last = int(row["step"]) - last, int(row["step"])
        busy = float(row["epoch_time_s"]) - float(row["eval_time_s"]) - float(row["snapshot_time_s"] or 0)
        per_step.append(busy / steps)
    return statistics.median(per_step[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the src/ folder of a checkout before the change")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    a = p.parse_args()
    after = str(HERE.parents[1] / "src")
    for name in a.workloads.split(","):
        overrides = WORKLOADS[name]
        ratios = []
        for r in range(a.rounds):  # alternating, each first in every other round: a change in load falls on both
            sides = (after, a.before) if r % 2 == 0 else (a.before, after)
            first, second = (step_seconds(src, overrides, a.nproc, a.epochs) for src in sides)
            new, old = (first, second) if r % 2 == 0 else (second, first)
            ratios.append(new / old)
            print(f"{name} nproc={a.nproc}: global count {new * 1e3:.2f} ms/step, per process {old * 1e3:.2f}")
        print(
            f"ratio global/per-process {name} nproc={a.nproc} {statistics.median(ratios):.3f} "
            f"(range {min(ratios):.3f}-{max(ratios):.3f}, {a.rounds} rounds)"
        )


if __name__ == "__main__":
    main()
