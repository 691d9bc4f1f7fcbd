"""What the Trainer trains with, built before it and handed to it (TrainParts), and the table of how each part is
built (Builders). The defaults are config-driven (training.optimizer may name the workload's own function:
engine/loop/optim.py); `ddplab.train(builders=...)` may replace any builder, which takes what the default beside it
takes: the section of the config it reads, not the whole config.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ddplab.config import batch_arithmetic
from ddplab.data.stream import declared, is_stream
from ddplab.engine.loop.loaders import Loaders, TrainFeed, train_feed
from ddplab.engine.loop.optim import build_optimizer, build_schedule, scaled_lr
from ddplab.engine.loop.rng import rng_state, set_rng_state
from ddplab.engine.loop.setup import distribute
from ddplab.engine.parallel.clock import InFlight
from ddplab.engine.parallel.fault_tolerance import NoReplicas
from ddplab.engine.parallel.sharding import Replicated, full_state, strategy
from ddplab.engine.snapshots.write import PER_RANK, Parts, part
from ddplab.workload import BuildConfig, Options

DEFAULT_EPOCHS = 2  # where training.epochs is not set


def grad_scaler(t, ctx) -> torch.amp.GradScaler:
    """Loss scaling for training.amp=fp16 (`t`: the training section) on CUDA; a scaler that does nothing otherwise."""
    return torch.amp.GradScaler("cuda", enabled=t.amp == "fp16" and ctx.device.type == "cuda")


@dataclass
class TrainParts:
    """The built parts, and the arithmetic they were built for."""

    model: torch.nn.Module  # what the loop calls: DDP- or FSDP-wrapped, compiled when asked
    raw: torch.nn.Module  # the module itself, whose parameters the optimizer holds
    comm: InFlight | None  # the monitor of its gradient communication (None in one process)
    optimizer: torch.optim.Optimizer
    scheduler: Any  # an LR scheduler, stepped once per optimizer step
    scaler: torch.amp.GradScaler
    loaders: Loaders
    feed: TrainFeed
    lr: float  # the peak learning rate, after training.lr_scaling
    shares: int  # processes the data and the global batch are divided among: world size x replica groups
    batch: dict  # batch_arithmetic over those shares
    epochs: float  # to train: training.epochs; a stream with training.max_steps and no epochs set, until then (inf)
    strategy: Replicated = field(default_factory=Replicated)  # how the model is held: whole (DDP) or sharded
    faults: NoReplicas = field(default_factory=NoReplicas)  # fault tolerance: none, or replica groups (set-up's)


@dataclass(frozen=True)
class Builders:
    """`t`: cfg.training; `d`: cfg.data; `job`: the BuildConfig a workload function gets (its `dist`: the ctx)."""

    distribute: Callable = distribute  # (model, cfg, ctx) -> (the model to train, its comm monitor or None)
    optimizer: Callable = build_optimizer  # (t, job, model, lr) -> torch.optim.Optimizer
    schedule: Callable = build_schedule  # (t, job, optimizer, total_steps) -> LR scheduler
    scaler: Callable = grad_scaler  # (t, ctx) -> torch.amp.GradScaler
    loaders: Callable = Loaders  # (d, ctx, collate_fn, batch_size, seed) -> Loaders
    feed: Callable = train_feed  # (dataset, loaders, d, ctx, log, (share, shares)) -> TrainFeed

    def build(self, cfg, ctx, data, model: torch.nn.Module, log: Callable[[str], None]) -> TrainParts:
        """Each part after those it needs: the optimizer takes the parameters as distributing left them
        (sharded, under FSDP), the schedule the optimizer and the steps the batch arithmetic gives."""
        t, d = cfg.training, cfg.distributed
        groups = d.replica_groups if d.fault_tolerance == "replicas" else 1  # engine/parallel/replicas.py
        shares = ctx.world_size * groups
        batch = batch_arithmetic(t.batch_size, t.grad_accum_steps, shares, declared(data.train, cfg.data.limit))
        epochs = t.epochs or (math.inf if is_stream(data.train) and t.max_steps else DEFAULT_EPOCHS)
        job = BuildConfig(Options({}), cfg, ctx.rank, ctx.world_size, ctx.launch.local_rank, ctx)
        wrapped, comm = self.distribute(model, cfg, ctx)
        lr = scaled_lr(t.lr, t.lr_scaling, shares)
        optimizer = self.optimizer(t, job, model, lr)
        scaler = self.scaler(t, ctx)
        loaders = self.loaders(cfg.data, ctx, data.collate_fn, t.batch_size, cfg.experiment.seed)
        share = (d.replica_group * ctx.world_size + ctx.rank, shares)
        feed = self.feed(data.train, loaders, cfg.data, ctx, log, share)
        scheduler = self.schedule(t, job, optimizer, t.max_steps or batch["steps_per_epoch"] * epochs)
        return TrainParts(
            wrapped, model, comm, optimizer, scheduler, scaler, loaders, feed, lr, shares, batch, epochs, strategy(cfg)
        )


def snapshot_parts(trainer) -> tuple[Parts, Parts]:
    """What a snapshot of `trainer` holds, by name: the one place a part is added (engine/snapshots/write.py writes
    and reads each kind); then what the best model's snapshot holds."""
    t = trainer
    about = {"meta": part(lambda: t.data.meta), "task": part(t.task.describe)}  # for predict, generate
    parts = Parts()
    t.strategy.register(parts, t.raw, t.optimizer)
    parts.add("scheduler", t.scheduler)
    parts.add("scaler", t.scaler)
    parts.add("trainer", t.state)
    parts.add("data", t.feed)  # a stream's own position (map-style data: the trainer's `consumed`)
    parts.add("data_identity", t.identity)  # what the data was: a rerun over other data is refused
    parts.add("rng", part(rng_state, set_rng_state), PER_RANK)
    parts.add("callbacks", t.callbacks)
    t.faults.register(parts)  # replica groups: the epoch's tally of groups present (its row's columns)
    for name, obj in about.items():
        parts.add(name, obj)
    for name, obj in t.data.state.items():  # the workload's own (ddplab.Data(state=...))
        parts.add(name, obj, PER_RANK)
    best = Parts()
    best.add("model", part(lambda: full_state(t.raw)))  # whole weights: a collective when sharded
    for name, obj in about.items():
        best.add(name, obj)
    return parts, best
