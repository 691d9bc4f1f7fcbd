"""`ddplab verify`: N-process DDP against one process with N x the per-process batch.

Both runs see the same samples in the same order (the sampler's global order is split
rank-strided, so N ranks' batches at step k are exactly the single process's batch k),
start from the same weights, and have dropout off. DDP should then change nothing but
speed: the loss at every step and the final weights agree up to float rounding.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ddplab.registry import load_config
from ddplab.engine.checkpoint import Checkpointer
from ddplab.errors import UserError
from ddplab.launch import torchrun_command
from ddplab.engine.run_folder import RunFolder


def _run(cmd: list[str], label: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        print(tail, file=sys.stderr)
        raise UserError(f"verify: the {label} run failed (exit {proc.returncode}); its last lines are above")


def _losses(run_dir: Path) -> dict[int, float]:
    summary = json.loads((run_dir / RunFolder.METRICS_JSON).read_text())
    return {row["step"]: row["loss"] for row in summary["steps"]}


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpts = Checkpointer(run_dir / RunFolder.CHECKPOINTS, is_main=False)
    return ckpts.load_snapshot(ckpts.latest())["model"]


def verify(config: str | None, overrides: list[str], nproc: int, tolerance: float, weight_tolerance: float) -> int:
    cfg = load_config(config, overrides)  # validates before anything starts
    steps = cfg.training.max_steps or 20
    with tempfile.TemporaryDirectory(prefix="ddplab-verify-") as tmp:
        forced = [f"training.max_steps={steps}", "training.epochs=1", "model.dropout=0", "logging.log_every=1",
                  "logging.trackers=[]", "logging.progress=false", "checkpoint.save_best=false",
                  "checkpoint.every=null", "training.eval_every=null", "generate.max_new_tokens=0",
                  "data.augment=false", f"experiment.output_dir={tmp}", "checkpoint.resume=never"]
        base = ([config] if config else []) + list(overrides) + forced
        batch = cfg.training.batch_size
        print(f"verify: {nproc} processes x batch {batch}  vs  1 process x batch {nproc * batch}, {steps} steps")
        _run(torchrun_command(nproc, ["train", *base, "experiment.name=ddp"]), f"{nproc}-process")
        _run([sys.executable, "-m", "ddplab", "train", *base, "experiment.name=single",
              f"training.batch_size={nproc * batch}"], "1-process")
        a, b = _losses(Path(tmp) / "ddp"), _losses(Path(tmp) / "single")
        common = sorted(set(a) & set(b))
        if not common:
            raise UserError("verify: the two runs recorded no common steps")
        loss_diff = max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-12) for k in common)
        wa, wb = _weights(Path(tmp) / "ddp"), _weights(Path(tmp) / "single")
        weight_diff = max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)
    print(f"steps compared: {len(common)}; first loss {b[common[0]]:.6f}, last loss {b[common[-1]]:.6f}")
    print(f"largest relative loss difference: {loss_diff:.3e} (tolerance {tolerance:g})")
    print(f"largest weight difference: {weight_diff:.3e} (tolerance {weight_tolerance:g})")
    ok = loss_diff <= tolerance and weight_diff <= weight_tolerance
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1
