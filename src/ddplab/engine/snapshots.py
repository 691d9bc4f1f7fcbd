"""What a snapshot holds, how the trainer writes one and how it continues from one.

A snapshot brings back everything a run needs to continue exactly: weights, optimizer,
schedule, scaler, progress (TrainState), the sampler's position and every rank's RNG streams.
"""

from __future__ import annotations

from dataclasses import asdict

from ddplab.engine.rng import rng_state, seed_everything, set_rng_state
from ddplab.engine.state import TrainState


def inference_payload(trainer, **extra) -> dict:
    """What `generate` / `predict` need: weights, config, task, tokenizer or labels."""
    return {"model": {k: v.detach().cpu() for k, v in trainer.raw.state_dict().items()},
            "config": trainer.cfg.to_dict(), "meta": trainer.data.meta, "task": trainer.task.describe(),
            "epoch": trainer.state.epoch + 1, "step": trainer.state.step, **extra}


def save(trainer) -> None:
    """A collective: every rank hands its RNG state to rank 0, which writes."""
    ctx, s, path = trainer.ctx, trainer.state, None
    rngs = ctx.gather_objects(rng_state())
    if ctx.is_main:
        state = {"model": trainer.raw.state_dict(), "optimizer": trainer.optimizer.state_dict(),
                 "scheduler": trainer.scheduler.state_dict(), "scaler": trainer.scaler.state_dict(),
                 "trainer": asdict(s), "rng": rngs, "world_size": ctx.world_size,
                 "sampler": {"seed": trainer.sampler.seed, "epoch": s.epoch, "consumed": s.consumed},
                 "config": trainer.cfg.to_dict(), "meta": trainer.data.meta}
        info = {"step": s.step, "epoch": s.epoch, "consumed": s.consumed, "world_size": ctx.world_size}
        path = trainer.checkpoints.save_snapshot(
            state, s.step, info, before_marker=lambda step: trainer.callbacks.on_snapshot_saving(trainer, step))
    ctx.barrier()
    trainer.callbacks.on_snapshot(trainer, path)


def resume(trainer) -> None:
    """Load the newest complete snapshot (checkpoint.resume=auto) or the one named."""
    how, run, ctx = trainer.cfg.checkpoint.resume, trainer.run, trainer.ctx
    if how == "never":
        return
    for name in trainer.checkpoints.clean_incomplete():
        run.log(f"removed incomplete snapshot {name} (a save was interrupted)")
    ctx.barrier()
    found = trainer.checkpoints.load_latest(run.log) if how == "auto" else (how, trainer.checkpoints.load_snapshot(how))
    if found is None:
        return
    where, snap = found
    trainer.raw.load_state_dict(snap["model"])
    trainer.optimizer.load_state_dict(snap["optimizer"])
    trainer.scheduler.load_state_dict(snap["scheduler"])
    trainer.scaler.load_state_dict(snap["scaler"])
    s = trainer.state = TrainState(**snap["trainer"])
    s.stop_reason = None
    s.resumes += 1
    if snap["world_size"] == ctx.world_size:
        set_rng_state(snap["rng"][ctx.rank])
    else:
        # The remaining samples of the epoch are re-divided among the new ranks (see the
        # sampler); per-rank random streams cannot carry over, so they are reseeded.
        seed_everything(trainer.cfg.experiment.seed + 1000 * s.step + ctx.rank)
        run.log(f"world size changed from {snap['world_size']} to {ctx.world_size}: the rest of epoch "
                f"{s.epoch + 1} is re-divided among {ctx.world_size} processes (no sample "
                f"repeated or lost); dropout streams are reseeded, so the run is no longer bit-identical")
    # Events logged after the snapshot by the attempt that died are dropped from TensorBoard.
    run.purge_step = s.step + 1
    run.log(f"resumed from {where} (epoch {s.epoch + 1}, step {s.step}, {s.consumed} samples into the epoch, "
            f"{s.elapsed:.1f} s already spent)")
