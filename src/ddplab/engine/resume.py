"""The contract of a resume, as the trainer keeps it: state_dict() / load_state_dict() hold
everything a run needs to continue exactly (weights, optimizer, schedule, scaler, progress and
position in the epoch, every rank's RNG streams, world size); a snapshot is that dict written by
rank 0 (engine/checkpoint.py), and nothing else reads or restores a run's state."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ddplab.config import batch_arithmetic, keep_global_batch
from ddplab.engine.checkpoint import SHARDS, load_shards
from ddplab.engine.clock import timed
from ddplab.engine.fingerprint import same_model
from ddplab.engine.rng import rng_state, seed_everything, set_rng_state
from ddplab.engine.sharding import load_model_and_optimizer, model_and_optimizer


@dataclass
class TrainState:
    """Everything about progress that a snapshot must bring back."""

    epoch: int = 0  # epochs fully completed
    step: int = 0  # optimizer steps taken
    consumed: int = 0  # samples of the current epoch's global order already trained on
    elapsed: float = 0.0  # seconds inside fit() (training, evaluation, snapshots), across restarts
    best_val_loss: float = math.inf
    best_epoch: int | None = None
    epoch_loss_sum: float = 0.0  # global, for the epoch in progress
    epoch_samples: float = 0.0
    epoch_tokens: float = 0.0
    epoch_time: float = 0.0  # the epoch's wall time so far: training, evaluation and snapshots
    epoch_eval_time: float = 0.0
    epoch_snapshot_time: float = 0.0
    epoch_data_wait: float = 0.0  # seconds this rank waited for its next batch
    history: list = field(default_factory=list)  # one dict per epoch
    steps: list = field(default_factory=list)  # one dict per log interval
    stop_reason: str | None = None  # epochs | max_steps | time_budget | preempted | a callback's request
    resumes: int = 0  # how many times this run was resumed from a snapshot
    snapshot_stalls: list = field(default_factory=list)  # {step, stall_s, async}: training held by each snapshot


class Resumable:
    """Mixed into the Trainer, whose attributes (raw, optimizer, scheduler, scaler, sampler, state,
    ctx, cfg, data, run, checkpoints, callbacks, view) it reads."""

    sharded = property(lambda self: self.cfg.distributed.strategy != "ddp")  # snapshots with DCP

    def state_dict(self) -> dict:
        """Everything a resume needs, the same on every rank. A collective: every rank's RNG
        streams are gathered. Tensors and plain values only (loads with weights_only=True).
        Sharded, the model and optimizer are this rank's shards, keyed by parameter name."""
        s = self.state
        weights = (model_and_optimizer(self.raw, self.optimizer) if self.sharded else
                   {"model": self.raw.state_dict(), "optimizer": self.optimizer.state_dict()})
        return {**weights, "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "trainer": asdict(s), "rng": self.ctx.gather_objects(rng_state()), "world_size": self.ctx.world_size,
                "sampler": {"seed": self.sampler.seed, "epoch": s.epoch, "consumed": s.consumed},
                "config": self.cfg.to_dict(), "meta": self.data.meta, "callbacks": self.callbacks.state_dict()}

    def load_state_dict(self, sd: dict, where: Path | None = None) -> None:
        if sd.get("sharded"):  # shards written by any world size, resharded to this one
            same_model(where, self.raw.state_dict(), sd["model"])
            weights = model_and_optimizer(self.raw, self.optimizer)
            load_shards(weights, where / SHARDS, self.ctx.is_distributed)
            load_model_and_optimizer(self.raw, self.optimizer, weights)
        else:
            self.raw.load_state_dict(sd["model"])
            self.optimizer.load_state_dict(sd["optimizer"])
        self.scheduler.load_state_dict(sd["scheduler"])
        self.scaler.load_state_dict(sd["scaler"])
        self.state = TrainState(**sd["trainer"])
        self.callbacks.load_state_dict(sd.get("callbacks", {}))
        self._keep_global_batch(sd)
        if sd["world_size"] == self.ctx.world_size:
            set_rng_state(sd["rng"][self.ctx.rank])
            return
        # The remaining samples of the epoch are re-divided among the new ranks (see the
        # sampler); per-rank random streams cannot carry over, so they are reseeded.
        seed_everything(self.cfg.experiment.seed + 1000 * self.state.step + self.ctx.rank)
        self.run.log(f"world size changed from {sd['world_size']} to {self.ctx.world_size}: the rest of epoch "
                     f"{self.state.epoch + 1} is re-divided among {self.ctx.world_size} processes (no sample "
                     f"repeated or lost); dropout streams are reseeded, so the run is no longer bit-identical")

    def _keep_global_batch(self, sd: dict) -> None:
        """The run's global batch on this world size and batch size: its accumulation steps are recomputed."""
        t, was = self.cfg.training, sd["config"]["training"]
        global_batch = was["batch_size"] * was["grad_accum_steps"] * sd["world_size"]
        accum = keep_global_batch(global_batch, t.batch_size, self.ctx.world_size)
        if accum != t.grad_accum_steps:
            self.run.log(f"training.grad_accum_steps {t.grad_accum_steps} -> {accum}: the global batch stays "
                         f"{global_batch} on {self.ctx.world_size} processes")
            t.grad_accum_steps = accum
            self.batch = batch_arithmetic(t.batch_size, accum, self.ctx.world_size, len(self.data.train))

    def snapshot(self) -> None:
        """A collective: the loss since the last log is reduced, then rank 0 writes the snapshot of its
        step (sharded: every rank writes its shards). The time training stood still for it is recorded."""
        self.log_interval()
        self._tick()
        with timed(self, "snapshot"):  # a snapshot holds the clock up to its own start
            began = time.perf_counter()
            state, s = self.state_dict(), self.state
            info = {"step": s.step, "epoch": s.epoch, "consumed": s.consumed, "world_size": self.ctx.world_size,
                    "global_batch": self.batch["global"]}
            if self.sharded:
                shards = {k: state.pop(k) for k in ("model", "optimizer")}
                path = self.checkpoints.save_sharded(shards, state, s.step, info, self.ctx, self.cfg.checkpoint.async_save)
            else:
                path = self.checkpoints.save_snapshot(state, s.step, info)
            self.ctx.barrier()
            stall = self.ctx.all_reduce(torch.tensor([time.perf_counter() - began], device=self.ctx.device), "max").item()
            s.snapshot_stalls.append({"step": s.step, "stall_s": stall,
                                      "async": self.sharded and self.cfg.checkpoint.async_save})
            self.callbacks.on_snapshot(self.view, path)

    def resume(self) -> None:
        """Continue from the snapshot checkpoint.resume names (auto: the newest complete one; never:
        none), after rank 0 cleaned what an interrupted save left behind."""
        self._resumed = True
        how = self.cfg.checkpoint.resume
        if how == "never":
            return
        for name in self.checkpoints.clean_incomplete():
            self.run.log(f"removed incomplete snapshot {name} (a save was interrupted)")
        self.ctx.barrier()
        found = (self.checkpoints.load_latest(self.run.log, weights=False) if how == "auto"
                 else (Path(how), self.checkpoints.load_snapshot(how, weights=False)))
        if found is None:
            return
        where, sd = found
        self.load_state_dict(sd, where)
        s = self.state
        if s.stop_reason in ("epochs", "max_steps", "time_budget", "preempted"):  # the loop checks these again
            s.stop_reason = None  # a callback's request stays: the run ended there
        s.resumes += 1
        self.run.log(f"resumed from {where} (epoch {s.epoch + 1}, step {s.step}, {s.consumed} samples into the "
                     f"epoch, {s.elapsed:.1f} s already spent)")
