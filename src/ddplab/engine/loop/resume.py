"""A Trainer continued from a snapshot (checkpoint.resume): its parts restored, the data checked to be the
snapshot's, the global batch kept on another world size, and whatever makes the resume less than exact said."""

from __future__ import annotations

from pathlib import Path

from ddplab.config import batch_arithmetic, keep_global_batch
from ddplab.engine.loop.preemption import STOPS
from ddplab.engine.loop.rng import seed_everything
from ddplab.errors import UserError


def resume(trainer) -> None:
    """Continue from the snapshot checkpoint.resume names (auto: the newest that passes its checks;
    never: none), after rank 0 cleaned what an interrupted save left behind."""
    t = trainer
    how = t.cfg.checkpoint.resume
    if how == "never":
        return
    for name in t.checkpoints.clean_incomplete():
        t.run.log(f"removed incomplete snapshot {name} (a save was interrupted)")
    t.ctx.barrier()
    found = t.checkpoints.restore(t.parts, t.ctx, t.run.log, None if how == "auto" else Path(how))
    if found is None:
        return
    where, manifest, left = found
    s = t.state
    check_data(t, where)
    keep_batch(t, manifest)
    if s.steps_per_epoch is not None:  # measured in an earlier epoch (a stream)
        t.replan(s.steps_per_epoch)
    if manifest["world_size"] != t.ctx.world_size:
        # The remaining samples of the epoch are re-divided among the new ranks (see the sampler);
        # per-rank random streams cannot carry over, so they are reseeded.
        seed_everything(t.cfg.experiment.seed + 1000 * s.step + t.ctx.rank)
        t.run.log(
            f"world size changed from {manifest['world_size']} to {t.ctx.world_size}: the rest of "
            f"epoch {s.epoch + 1} is re-divided among {t.ctx.world_size} processes (no sample repeated "
            f"or lost); dropout streams are reseeded, so the run is no longer bit-identical"
        )
    if as_built := [name for name in left if name != "rng"]:
        t.run.log(
            f"not restored from the snapshot (absent, or per rank at another world size), left as "
            f"built: {', '.join(as_built)}"
        )
    if s.stop_reason in ("epochs", "max_steps", "time_budget", *STOPS):  # the loop checks these again
        s.stop_reason = None  # a callback's request stays: the run ended there
    s.resumes += 1
    t.run.log(
        f"resumed from {where} (epoch {s.epoch + 1}, step {s.step}, {s.consumed} samples into the "
        f"epoch, {s.elapsed:.1f} s already spent)"
    )


def check_data(trainer, where: Path) -> None:
    """The data must be what the snapshot was trained on (its files, sizes and first items), or a resume
    would read other samples than it says: refused, unless checkpoint.allow_changed_data, then recorded."""
    changed = trainer.identity.changes()
    if not changed:
        return
    if not trainer.cfg.checkpoint.allow_changed_data:
        raise UserError(
            f"the data changed since the snapshot {where.name}: {changed}; resume over the data it was "
            f"trained on, or set checkpoint.allow_changed_data=true to go on with this data"
        )
    trainer.run.log(
        f"the data changed since the snapshot {where.name}: {changed}; going on with it "
        f"(checkpoint.allow_changed_data=true): the resume is not exact"
    )
    trainer.state.data_notes.append({"step": trainer.state.step, "data_changed": changed})


def keep_batch(trainer, manifest: dict) -> None:
    """The run's global batch on this world size and batch size: its accumulation steps are recomputed, into
    the batch arithmetic (the config stays as given)."""
    t, global_batch = trainer.cfg.training, manifest["global_batch"]
    accum = keep_global_batch(global_batch, t.batch_size, trainer.shares)
    if accum != t.grad_accum_steps:
        # replica groups: planned with all present (each step's: replicas.csv)
        on = trainer.faults.shares(trainer.ctx.world_size, trainer.shares)
        trainer.run.log(
            f"training.grad_accum_steps {t.grad_accum_steps} -> {accum}: the global batch stays {global_batch} on {on}"
        )
        trainer.batch = batch_arithmetic(t.batch_size, accum, trainer.shares, trainer.feed.size)
