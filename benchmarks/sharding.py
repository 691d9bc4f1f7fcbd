"""What sharding costs and saves: the char GPT on 2 CPU processes, fsdp beside ddp, as ratios.

- per-rank bytes of parameters + gradients + optimizer state (the sum of metrics.json ddp.state_bytes_per_rank),
  target <= 0.55x DDP's;
- step time (training time of the epochs after the first, per optimizer step), target <= 1.3x DDP's, and
  the part of it with a collective in flight (metrics.json comm_time_s), no target;
- the stall a snapshot causes (metrics.json ddp.snapshot_stalls, the slowest rank's median), fsdp with
  checkpoint.async_save=true against the synchronous write, target <= 0.3x; on a larger GPT
  (--stall-layers, --stall-dim: 25 M parameters, 150 MB of state per rank), whose write is worth hiding;
- the same stalls with checkpoint.checksums=true (the default: a CRC-32 of every file in the manifest) against
  false (sizes only), sync and async, target <= 1.1x.

    python benchmarks/sharding.py [--epochs 3] [--repeat 2] [--layers 4 --dim 256] [--stall-layers 8 --stall-dim 512]
    python benchmarks/sharding.py --stall-only   # the snapshot stalls alone
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

COMMON = [
    "model.name=gpt",
    "data.name=text",
    "model.heads=4",
    "model.context=64",
    "training.batch_size=32",
    "data.limit=2048",
    "training.clip_grad_norm=1.0",
    "model.dropout=0",
    "logging.trackers=[]",
    "logging.progress=false",
    "checkpoint.save_best=false",
    "generate.max_new_tokens=0",
    "logging.log_every=8",
]


def train(out: Path, name: str, args: list[str]) -> dict:
    shutil.rmtree(out / name, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "ddplab",
        "train",
        *COMMON,
        *args,
        f"experiment.output_dir={out}",
        f"experiment.name={name}",
        "--nproc-per-node",
        "2",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{name} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads((out / name / "metrics.json").read_text())


def step_time(summary: dict) -> float:
    """Seconds per optimizer step over the epochs after the first (start-up and warm-up left out)."""
    epochs = summary["epochs"][1:] or summary["epochs"]
    return sum(e["epoch_time_s"] for e in epochs) / (summary["ddp"]["steps_per_epoch"] * len(epochs))


def comm_time(summary: dict) -> float:
    """Seconds per optimizer step in which a collective was in flight (DDP's all-reduce; FSDP's gathers and
    reduce-scatters), over the same epochs; hidden by compute or not."""
    epochs = summary["epochs"][1:] or summary["epochs"]
    return sum(e["comm_time_s"] for e in epochs) / (summary["ddp"]["steps_per_epoch"] * len(epochs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="interleaved runs of each strategy for the step time (the median is printed)",
    )
    p.add_argument("--stall-layers", type=int, default=8)
    p.add_argument("--stall-dim", type=int, default=512)
    p.add_argument("--snapshots", type=int, default=4, help="snapshots taken in each stall run")
    p.add_argument("--stall-only", action="store_true", help="only the snapshot stalls (with and without checksums)")
    p.add_argument("--out", default="/tmp/ddplab-bench-sharding")
    a = p.parse_args()
    out = Path(a.out)
    size = [f"model.layers={a.layers}", f"model.dim={a.dim}"]
    # Interleaved repeats: the median run of each, with the range of step times printed beside it.
    every = [
        f"model.layers={a.stall_layers}",
        f"model.dim={a.stall_dim}",
        "training.batch_size=8",
        "training.epochs=1",
        "data.val_fraction=0.01",
        f"training.max_steps={2 * a.snapshots}",
        "checkpoint.every=2",
        "distributed.strategy=fsdp",
    ]
    # The stall of each (write mode, checksums) pair: interleaved runs, each the median of its snapshots.
    stalls = {(mode, crc): [] for mode in ("sync", "async") for crc in (True, False)}
    for _ in range(a.repeat):
        for mode, crc in stalls:
            summary = train(
                out,
                f"stall-{mode}-{crc}",
                [*every, f"checkpoint.async_save={mode == 'async'}", f"checkpoint.checksums={str(crc).lower()}"],
            )
            stalls[mode, crc].append(statistics.median(s["stall_s"] for s in summary["ddp"]["snapshot_stalls"]))
    stall = {key: statistics.median(values) for key, values in stalls.items()}
    print(
        f"snapshot stall (s), fsdp GPT {a.stall_layers}x{a.stall_dim}, median of {a.repeat} interleaved runs "
        f"(range) with checksums (CRC-32C of every file, in the manifest) against without (sizes only):"
    )
    for mode in ("sync", "async"):
        on, off = stalls[mode, True], stalls[mode, False]
        ratio = stall[mode, True] / stall[mode, False]
        verdict = f"<= 1.1x {'ok' if ratio <= 1.1 else 'MISSED'}"
        print(
            f"  {mode:5}  checksums {stall[mode, True]:.4f} ({min(on):.4f}-{max(on):.4f})  none "
            f"{stall[mode, False]:.4f} ({min(off):.4f}-{max(off):.4f})  {ratio:.2f}x  {verdict}"
        )
    if a.stall_only:
        print(f"load average {os.getloadavg()[0]:.2f}")
        return
    runs = {"ddp": [], "fsdp": []}
    for i in range(a.repeat):
        for strategy in runs:
            runs[strategy].append(
                train(
                    out, f"{strategy}-{i}", [*size, f"training.epochs={a.epochs}", f"distributed.strategy={strategy}"]
                )
            )
    ddp, fsdp = (sorted(runs[strategy], key=step_time)[(a.repeat - 1) // 2] for strategy in ("ddp", "fsdp"))
    stalls = {"sync": stall["sync", True], "async": stall["async", True]}

    params = fsdp["model"]["parameters"]
    print(f"char GPT, {params:,} parameters ({a.layers} layers, dim {a.dim}), 2 processes on CPU (gloo)")
    rows = [
        (
            "per-rank param+grad+optimizer bytes",
            sum(ddp["ddp"]["state_bytes_per_rank"].values()),
            sum(fsdp["ddp"]["state_bytes_per_rank"].values()),
            0.55,
            "{:,.0f}",
        ),
        ("step time (s)", step_time(ddp), step_time(fsdp), 1.3, "{:.4f}"),
        ("communication in a step (s)", comm_time(ddp), comm_time(fsdp), None, "{:.4f}"),
        (
            f"snapshot stall (s), {a.stall_layers}x{a.stall_dim}: sync | async",
            stalls["sync"],
            stalls["async"],
            0.3,
            "{:.4f}",
        ),
    ]
    print(f"{'':42} {'ddp / sync':>14} {'fsdp / async':>14} {'ratio':>7}  target")
    for name, base, new, target, fmt in rows:
        ratio = new / base
        verdict = "" if target is None else f"<= {target}x {'ok' if ratio <= target else 'MISSED'}"
        print(f"{name:42} {fmt.format(base):>14} {fmt.format(new):>14} {ratio:>6.2f}x  {verdict}")
    spread = {s: f"{min(map(step_time, r)):.4f}-{max(map(step_time, r)):.4f}" for s, r in runs.items()}
    print(
        f"step time range over {a.repeat} interleaved runs: ddp {spread['ddp']}, fsdp {spread['fsdp']}; "
        f"load average {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
