"""`ddplab verify`: N-process DDP against one process with N x the per-process batch: the same samples in the
same order, the same weights, dropout off, augmentation from per-sample seeds, so the loss at every step and
the final weights agree up to rounding; what randomness remains is named in the verdict with its remedy.
The runs live in `<output_dir>/verify-<digest>` until compared: a pre-empted verify continues there."""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import sys
from pathlib import Path

import torch

from ddplab.commands.launch import log_tail, run, torchrun_command
from ddplab.engine.run_folder.folder import RunFiles, RunFolder
from ddplab.engine.snapshots.read import load_snapshot
from ddplab.engine.snapshots.write import Checkpointer
from ddplab.errors import ExitCode, Preempted, RunError, UserError, stopped
from ddplab.registry import load_config

LOG_FILE = "verify.log"


def _run(nproc: int, args: list[str], work: Path) -> None:
    # The 1-process reference is a plain process, as `ddplab train` without --nproc-per-node: no agent to start.
    command = torchrun_command(nproc, args) if nproc > 1 else [sys.executable, "-m", "ddplab", *args]
    ended = run([command], log=work / LOG_FILE, report_in=work)
    if ended.stopped or ended.code in (ExitCode.PREEMPTED, ExitCode.INTERRUPTED):
        raise stopped(ended.kind or "preempted", "verify {stop}; the same command continues it")
    if ended.error and ended.code == ExitCode.USAGE:
        raise UserError(ended.error)
    if ended.error and ended.code == ExitCode.FAILED and len(ended.error.splitlines()) == 1:
        raise RunError(f"verify: the {nproc}-process run {ended.error}")  # "failed: <its cause>"
    if ended.code != 0:
        print(log_tail(work / LOG_FILE), file=sys.stderr)
        raise RunError(f"verify: the {nproc}-process run failed (exit {ended.code}); its last lines are above")


def _result(run_dir: Path) -> tuple[dict[int, float], dict[str, torch.Tensor], dict]:
    """(loss per step, final weights, the stochastic parts of model and data) one of the two runs recorded."""
    summary = RunFiles(run_dir).summary()
    latest = Checkpointer(run_dir / RunFolder.CHECKPOINTS, is_main=False).latest()
    if summary is None or latest is None:
        raise RunError(f"verify: {run_dir} holds no {'snapshot' if summary else 'metrics.json'}")
    losses = {row["step"]: row["loss"] for row in summary["steps"]}
    found = {**summary["model"].get("stochastic", {}), "loss_average": summary["model"].get("loss_average")}
    return losses, load_snapshot(latest)["model"], found


def verify(config: str | None, overrides: list[str], nproc: int, tolerance: float, weight_tolerance: float) -> int:
    cfg = load_config(config, overrides)  # validates before anything starts
    steps = cfg.training.max_steps or 20
    digest = hashlib.sha1(json.dumps([cfg.to_dict(), nproc], sort_keys=True, default=str).encode()).hexdigest()
    work = Path(cfg.experiment.output_dir) / f"verify-{digest[:10]}"
    forced = [
        f"training.max_steps={steps}",
        "training.epochs=1",
        "model.dropout=0",
        "model.dropout_off=true",
        "logging.log_every=1",
        "logging.trackers=[]",
        "logging.progress=false",
        "checkpoint.save_best=false",
        "checkpoint.every=null",
        "training.eval_every=null",
        "generate.max_new_tokens=0",
        f"experiment.output_dir={work}",
        "checkpoint.resume=auto",
    ]
    seeded = cfg.data.per_sample_seed and cfg.data.decode != "gpu"  # random augmentation drawn alike in both runs
    if not seeded:  # each process would draw its own
        forced.append("data.augment=false")
    base = ([config] if config else []) + list(overrides) + forced
    batch = cfg.training.batch_size
    print(f"verify: {nproc} processes x batch {batch}  vs  1 process x batch {nproc * batch}, {steps} steps")
    if work.exists():
        print(f"verify: continuing the pre-empted runs in {work}")
    work.mkdir(parents=True, exist_ok=True)
    keep = False
    try:
        for name, procs, extra in (("ddp", nproc, []), ("single", 1, [f"training.batch_size={nproc * batch}"])):
            if not RunFiles(work / name).finished():  # done before a pre-emption: kept
                _run(procs, ["train", *base, f"experiment.name={name}", *extra], work)
        (a, wa, _), (b, wb, found) = _result(work / "ddp"), _result(work / "single")
        common = sorted(set(a) & set(b))
        if not common:
            raise UserError("verify: the two runs recorded no common steps")
        loss_diff = max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-12) for k in common)
        weight_diff = max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)
    except Preempted:
        keep = True
        raise
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
            with contextlib.suppress(OSError):
                work.parent.rmdir()  # the output folder, when verify made it
    print(f"steps compared: {len(common)}; first loss {b[common[0]]:.6f}, last loss {b[common[-1]]:.6f}")
    print(f"largest relative loss difference: {loss_diff:.3e} (tolerance {tolerance:g})")
    print(f"largest weight difference: {weight_diff:.3e} (tolerance {weight_tolerance:g})")
    ok = loss_diff <= tolerance and weight_diff <= weight_tolerance
    for line in _randomness(found, nproc, batch, seeded):
        print(line)
    drawn_apart = not seeded and found.get("random_transforms")
    remaining = drawn_apart or found.get("batchnorm_modules") or found.get("dropout_modules")
    if not ok and found.get("loss_average") == "samples, each with many targets":
        print(
            "loss: averaged per process over its own samples, whose targets hold many values each, and the task "
            "counts no items (Task.items gave None): a loss that is a mean over tokens inside a sample then "
            "differs between N x B and 1 x N*B; give the Task an items(target) that counts what its loss averages "
            "over (docs/your-workload.md#tasks)"
        )
    print("PASS" if ok else "FAIL" + (" (see the randomness named above)" if remaining else ""))
    return ExitCode.OK if ok else ExitCode.FAILED


def _randomness(found: dict, nproc: int, batch: int, seeded: bool) -> list[str]:
    """The stochastic parts of the model and data the runs reported, each with what verify did or what to do."""
    lines = [
        "randomness: dropout off in both runs; "
        + ("augmentation drawn from per-sample seeds" if seeded else "data.augment off")
    ]
    if found.get("dropout_modules"):
        lines.append(
            f"randomness: {found['dropout_modules']} dropout module(s) still drawing (not torch.nn.Dropout "
            f"subclasses?): set their p to 0 for verify"
        )
    if found.get("batchnorm_modules"):
        lines.append(
            f"randomness: {found['batchnorm_modules']} BatchNorm module(s): each of the {nproc} processes "
            f"normalises its own {batch} samples, the single process all {nproc * batch}, so their batch "
            f"statistics differ by more than rounding; on CUDA add distributed.sync_batchnorm=true, or verify a "
            f"model without BatchNorm (GroupNorm, LayerNorm), or accept a larger --tolerance"
        )
    if found.get("random_transforms"):
        names = ", ".join(found["random_transforms"])
        lines.append(
            f"randomness: random transforms on the training set ({names})"
            + (
                " drawn from per-sample seeds: the same draws in both runs"
                if seeded
                else ": each process draws its own: keep data.per_sample_seed=true, or turn them off for verify"
            )
        )
    return lines
