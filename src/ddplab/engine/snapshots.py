"""Snapshots as files: a Trainer.state_dict() written by rank 0, and found again on resume.

What a snapshot holds is the trainer's contract (Trainer.state_dict / load_state_dict); this
module only decides where it goes and which one comes back.
"""

from __future__ import annotations

from pathlib import Path

from ddplab.engine.checkpoint import Checkpointer


def save(checkpoints: Checkpointer, state: dict) -> Path | None:
    """Rank 0 writes `state` as the snapshot of its step (other ranks: None)."""
    s = state["trainer"]
    info = {"step": s["step"], "epoch": s["epoch"], "consumed": s["consumed"], "world_size": state["world_size"]}
    return checkpoints.save_snapshot(state, s["step"], info)


def find(checkpoints: Checkpointer, how: str, log, barrier) -> tuple[Path | str, dict] | None:
    """The snapshot to continue from (checkpoint.resume: auto = the newest complete one, never,
    or a path), after rank 0 cleaned what an interrupted save left behind."""
    if how == "never":
        return None
    for name in checkpoints.clean_incomplete():
        log(f"removed incomplete snapshot {name} (a save was interrupted)")
    barrier()
    if how == "auto":
        return checkpoints.load_latest(log)
    return how, checkpoints.load_snapshot(how)


def inference_payload(model, cfg, data, epoch: int, step: int, **extra) -> dict:
    """What `generate` / `predict` need (best.pt): weights, config, task, tokenizer or labels."""
    return {"model": {k: v.detach().cpu() for k, v in model.state_dict().items()}, "config": cfg.to_dict(),
            "meta": data.meta, "task": data.task.describe(), "epoch": epoch, "step": step, **extra}
