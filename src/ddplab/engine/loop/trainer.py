"""The training loop: resume(), then fit() = [train an epoch -> evaluate -> record -> snapshot] until done.

It steps, accumulates, evaluates and stops; the rest hangs on callbacks (engine/loop/view.py). Every number it records
is global: per-rank sums are all-reduced. It is handed its modes and never asks which it has: fault tolerance, sharding
strategy and data feed. Stops are agreed by all ranks after a step; a snapshot holds what snapshot_parts() registers.
"""

from __future__ import annotations

import gc
import itertools
import math
import time

import torch

from ddplab.config import Config
from ddplab.data.stream import size
from ddplab.engine.loop.data_identity import DataIdentity
from ddplab.engine.loop.ledger import LossLedger, loss_weights
from ddplab.engine.loop.optim import Schedule, plan_for_budget
from ddplab.engine.loop.parts import TrainParts, snapshot_parts
from ddplab.engine.loop.preemption import STOPS
from ddplab.engine.loop.setup import autocast, unused_parameters
from ddplab.engine.loop.state import TrainState
from ddplab.engine.loop.stops import Stops
from ddplab.engine.loop.view import CallbackList, TrainView
from ddplab.engine.parallel.clock import Clock
from ddplab.engine.parallel.distributed import DistContext
from ddplab.engine.parallel.sharding import is_sharded, load_full
from ddplab.engine.run_folder.folder import RunFolder
from ddplab.engine.snapshots.read import BEST, load_snapshot
from ddplab.engine.snapshots.write import Checkpointer
from ddplab.tasks import call_model, item_counter, to_device


class Trainer:
    """Driven through fit() / test() / end() / close() (engine/loop/session.py), observed through `view`."""

    def __init__(self, cfg: Config, ctx: DistContext, data, parts: TrainParts, run: RunFolder, callbacks=()) -> None:
        self.cfg, self.ctx, self.data, self.run = cfg, ctx, data, run
        t = cfg.training
        self.task = data.task
        self.model, self.raw, self.comm = parts.model, parts.raw, parts.comm
        self.items = item_counter(self.task, self.raw)  # what the loss of a batch is a mean over (Task.items)
        self.optimizer, self.scheduler, self.scaler = parts.optimizer, parts.scheduler, parts.scaler
        self.loaders, self.feed, self.faults, self.strategy = parts.loaders, parts.feed, parts.faults, parts.strategy
        self.lr, self.shares, self.batch, self.epochs = parts.lr, parts.shares, parts.batch, parts.epochs
        self.autocast = autocast(t.amp, ctx.device)
        self.state = TrainState()
        self.clock = Clock(self.state, ctx)
        self.checkpoints = Checkpointer(
            run.path / RunFolder.CHECKPOINTS, ctx.is_main, cfg.checkpoint.keep_last, cfg.checkpoint.checksums
        )
        self.stops = Stops(t, cfg.logging.log_every, ctx, self.state, run.log, self.faults)
        self.callbacks = CallbackList(callbacks, self.stops.signals.interrupt)
        self.view = TrainView(self)
        self.evaluator: object = None  # the last evaluation's (the view hands it to the class report)
        self.ledger = LossLedger(cfg.logging.log_every * t.grad_accum_steps, ctx.device)
        self.identity = DataIdentity(data, ctx)
        self.parts, self.best_parts = snapshot_parts(self)
        self.eval_at = "train"  # see evaluate()
        self.last_step_samples = 0  # this rank's samples in the last step
        self.in_epoch = False  # from an epoch's start until it is whole (view.epoch counts it)
        self.improved = False  # the last epoch-end evaluation set a new best
        self.loss_average: str | None = None  # items | samples[, each with many targets]: for metrics.json

    def _about(self, **extra) -> dict:
        """What a snapshot's manifest says of the run besides its files."""
        s, run = self.state, {"world_size": self.ctx.world_size, "global_batch": self.batch["global"]}
        return {"step": s.step, "epoch": s.epoch, "consumed": s.consumed, **run, "config": self.cfg.to_dict(), **extra}

    def fit(self) -> TrainState:
        """Train from the state resume() left (the session resumes first), until a stop or the last epoch."""
        self.faults.sync_step(self.state.step)
        t, s = self.cfg.training, self.state
        self.clock.restart()  # callbacks' time counts, on_train_start's in epoch 1
        self.callbacks.on_train_start(self.view)
        self.stops.signals.install()
        try:
            if s.stop_reason is not None:  # kept by resume: a callback's request ended this run
                self.run.log(f"this run stopped at step {s.step} ({s.stop_reason}): nothing left to train")
            elif t.max_steps and s.step >= t.max_steps:
                s.stop_reason = "max_steps"
            while s.epoch < self.epochs and s.stop_reason is None:
                if self.train_epoch():
                    self.end_of_epoch()
                    self.snapshot()
                else:
                    self.stop_mid_epoch()
            self.checkpoints.wait()  # a background snapshot is complete before the run goes on or ends
        except BaseException:
            self.checkpoints.settle()  # a background snapshot already written still gets its marker
            raise
        finally:
            self.stops.signals.restore()
        s.stop_reason = s.stop_reason or "epochs"
        return s

    def train_epoch(self) -> bool:
        """Train until the epoch ends (True) or a stop is agreed (False)."""
        t, s = self.cfg.training, self.state
        batches = self.feed.epoch(s.epoch, s.consumed)
        if self.feed.inexact is not None:  # said in the log as the epoch resumed; recorded here
            s.data_notes.append({"step": s.step, "resume_not_exact": self.feed.inexact})
            self.feed.inexact = None
        left = self.feed.left()  # samples still to come on this rank
        self.in_epoch = True
        self.callbacks.on_epoch_start(self.view)
        while left > 0:
            if self.faults.begin_step():  # a peer's state replaced this one's: its position in its epoch
                self.ledger.totals()  # the loss this process summed before it left is not the run's: dropped
                batches, left = self.feed.epoch(s.epoch, s.consumed), self.feed.left()
            waited = time.perf_counter()
            self.ctx.beat.mark("data", s.step + 1)
            micro = self.feed.next_step(batches, self.batch["grad_accum_steps"])
            s.epoch_data_wait += time.perf_counter() - waited
            if not micro:
                break
            self.train_step(micro)
            left -= self.last_step_samples
            self.callbacks.on_step_end(self.view)
            if s.step % self.cfg.logging.log_every == 0:
                self.log_interval()
            if self.cfg.checkpoint.every and s.step % self.cfg.checkpoint.every == 0:
                self.snapshot()
            if t.eval_every and s.step % t.eval_every == 0:
                self.evaluate(self.data.val, "val")
            self.clock.tick()  # after the log interval's sync: the time budget sees the device's work
            if self.stops.after_step():
                break
        if left > 0 and s.stop_reason is not None:
            return False
        s.consumed = 0
        return True

    def train_step(self, micro: list) -> None:
        """One optimizer step over `micro` batches; the update only where the step counts (faults.agree)."""
        step = self.state.step + 1
        samples = self.forward_backward(micro, step)
        self.ctx.beat.mark("optimizer")
        if self.faults.agree(self.raw.parameters(), self.optimizer, self.stops.own, step, samples):
            self.update(step)
        else:  # its gradients and loss are dropped; its data stays read (skipped)
            self.optimizer.zero_grad(set_to_none=True)
            self.ledger.drop_step(step)
        self.last_step_samples = samples
        self.state.consumed += samples * self.shares

    def forward_backward(self, micro: list, step: int) -> int:
        """Each micro-batch's loss, weighted into the global mean, and its gradients; this rank's samples."""
        n, mark, samples = len(micro), self.ctx.beat.mark, 0
        unpacked = [self.task.unpack(to_device(batch, self.ctx.device)) for batch in micro]
        counts, weights, self.loss_average = loss_weights(self.items, unpacked, self.ctx)
        for i, (inputs, target, n_samples) in enumerate(unpacked):
            samples += n_samples
            with self.strategy.micro_step(self.model, last=i == n - 1):
                mark("forward")
                try:
                    with self.autocast():
                        loss = self.task.loss(call_model(self.model, inputs), target)
                except RuntimeError as exc:
                    if (unused := unused_parameters(exc, self.raw)) is None:
                        raise
                    raise unused from None
                mark("backward")
                self.scaler.scale(loss * weights[i] if weights else loss / n if n > 1 else loss).backward()
            self.ledger.add(loss, n_samples, self.task.tokens(inputs, target), step, counts[i] if weights else None)
        return samples

    def update(self, step: int) -> None:
        """Clip, skip a non-finite step, step the optimizer (through the scaler) and the schedule; count the step."""
        t, s = self.cfg.training, self.state
        if t.clip_grad_norm:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.raw.parameters(), t.clip_grad_norm)
        # Every rank agrees (reduced flag), so all skip the same step and stay identical. A non-finite
        # loss under training.nonfinite=stop is found by the ledger at the next log interval.
        skip = t.nonfinite == "skip" and not self.ledger.finite(step, self.ctx)
        if skip:
            self.run.log(f"step {step}: non-finite loss on some rank; step skipped (training.nonfinite=skip)")
            self.ledger.drop_step(step)
        if not skip or self.scaler.is_enabled():  # the scaler skips non-finite gradients itself and lowers its scale
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.faults.restore_lr(self.optimizer)
        self.scheduler.step()
        s.step = step
        s.epoch_steps += 1

    def log_interval(self) -> None:
        """Reduce the train loss since the last log (a callback's stop request rides along): the one host sync."""
        s = self.state
        asked = self.stops.request is not None
        loss_sum, weight, samples, tokens, asking = self.ledger.reduce(self.ctx, self.cfg.logging.log_every, asked)
        if asking and s.stop_reason is None:
            self.stops.agree_on_request()
        if samples == 0:
            return
        s.epoch_loss_sum, s.epoch_loss_weight = s.epoch_loss_sum + loss_sum, s.epoch_loss_weight + weight
        s.epoch_samples, s.epoch_tokens = s.epoch_samples + samples, s.epoch_tokens + tokens
        values = {"loss": loss_sum / weight, "lr": self.scheduler.get_last_lr()[0]}
        s.steps.append({"step": s.step, "epoch": s.epoch + 1, **values, "elapsed_s": s.elapsed})
        # A time budget's schedule is planned over the steps it allows, re-estimated here, where all ranks meet anyway.
        spent = self.faults.spent(s.elapsed)  # replica groups: the same in every group
        plan_for_budget(self.scheduler, self.ctx, s.step, spent, self.stops.budget)
        self.callbacks.on_log(self.view, values)

    def stop_mid_epoch(self) -> None:
        """Snapshot where the stop happened; then (unless pre-empted or interrupted) evaluate and record it."""
        s = self.state
        self.snapshot()
        self.run.log(
            f"stopped ({s.stop_reason}) after step {s.step}, {s.consumed} samples into epoch {s.epoch + 1}; "
            f"snapshot saved"
        )
        if s.stop_reason not in STOPS:  # a row for the part-epoch, after the snapshot: a resumed run finishes the
            self.end_of_epoch(partial=True)  # epoch from the snapshot's sums, so metrics.csv never holds it twice

    def end_of_epoch(self, partial: bool = False) -> dict:
        """The epoch's core row (global numbers); the modes' columns; callbacks add theirs and record it."""
        s = self.state
        self.log_interval()
        val = self.evaluate(self.data.val, "val", "epoch_end")
        data_wait = self._slowest(s.epoch_data_wait)  # the slowest rank's wait holds the others at the next all-reduce
        self.clock.tick()
        row = s.epoch_row(self.view.epoch, val, self.scheduler.get_last_lr()[0], data_wait)
        row.update(self.faults.epoch_columns())
        if partial:
            row["partial"] = True
        else:  # a stream's epoch, measured; whole now: its hooks and the snapshot after it see it done
            planned = self.batch["steps_per_epoch"]
            row.update(self.feed.end_epoch(s.epoch + 1, s.epoch_steps, planned, s.data_notes, self.replan))
            s.epoch, self.in_epoch = s.epoch + 1, False
        s.history.append(row)
        self.callbacks.on_epoch_end(self.view, row)
        if not partial:
            s.next_epoch()
        if self.cfg.checkpoint.save_best and (not val or self.improved):
            with self.clock.timed("snapshot"):
                self.checkpoints.save(self.best_parts, self.ctx, BEST, self._about(val_loss=val.get("loss")))
        return row

    def replan(self, steps: int) -> int | float:
        """Steps an epoch as measured: the ETA's and the schedule's plan to the run's end; the total planned."""
        self.batch["steps_per_epoch"] = self.state.steps_per_epoch = steps
        total = min(self.cfg.training.max_steps or math.inf, steps * self.epochs)
        if math.isfinite(total) and isinstance(self.scheduler, Schedule):
            self.scheduler.plan(int(total))
        return total

    def snapshot(self) -> None:
        """A collective: the loss since the last log is reduced, then every part is written; the stall recorded."""
        self.log_interval()
        self.clock.tick()
        with self.clock.timed("snapshot"):  # a snapshot holds the clock up to its own start
            began = time.perf_counter()
            s, background = self.state, self.strategy.background
            path = self.checkpoints.save(self.parts, self.ctx, f"step-{s.step:09d}", self._about(), background)
            self.ctx.barrier()
            stall = self._slowest(time.perf_counter() - began)
            s.snapshot_stalls.append({"step": s.step, "stall_s": stall, "async": background})
            self.callbacks.on_snapshot(self.view, path)

    def _slowest(self, seconds: float) -> float:
        return self.ctx.all_reduce(torch.tensor([seconds], device=self.ctx.device), "max").item()

    def evaluate(self, dataset, split: str, at: str = "train") -> dict:
        """`at`: train (training.eval_every) | epoch_end | test: where the evaluation was asked for (view.eval_at)."""
        if dataset is None or size(dataset) == 0:
            return {}
        self.eval_at = at
        with self.clock.timed("eval"):
            batches = self.loaders.evaluation(dataset)
            metrics, self.evaluator = evaluate_model(self.raw, self.task, batches, self.ctx, self.autocast)
            s = self.state
            self.improved = self.eval_at == "epoch_end" and metrics["loss"] < s.best_val_loss
            if self.improved:  # the best is an epoch's; its hooks see this evaluation in view.best
                s.best_val_loss, s.best_epoch = metrics["loss"], self.view.epoch
            self.callbacks.on_eval_end(self.view, split, metrics)
        self.eval_at = "train"
        return metrics

    def test(self) -> dict:
        """The best model (by validation loss; the last one without it) on the test split."""
        if self.data.test is None:
            return {}
        self.ctx.barrier()
        if (best := self.checkpoints.root / BEST).is_dir():
            load_full(self.raw, load_snapshot(best)["model"])
        return self.evaluate(self.data.test, "test", "test")

    def close(self) -> None:
        """Stop the loaders' workers; drop the DDP model and optimizer before the process group (or gloo aborts)."""
        self.faults.close()
        self.loaders.close()
        for name in ("model", "optimizer", "scheduler", "scaler", "raw", "feed", "loaders", "comm", "evaluator"):
            delattr(self, name)
        gc.collect()


@torch.no_grad()
def evaluate_model(model: torch.nn.Module, task, batches, ctx, autocast) -> tuple[dict, object]:
    """(metrics, the evaluator) for the batches of a loader (`task.unpack` reads each), with the unwrapped model."""
    # DDP syncs buffers at the start of each training forward, so after the last step every
    # rank holds its own BatchNorm statistics: evaluate all shards with rank 0's, as DDP would.
    ctx.broadcast_buffers(model)
    was_training = model.training
    model.eval()
    evaluator = task.evaluator(ctx.device)
    if hasattr(evaluator, "items"):  # a loss that is a mean over items: counted as the model counts them
        evaluator.items = item_counter(task, model)
    passes = _passes(batches, ctx) if is_sharded(model) else batches
    inputs = None
    for batch in passes:
        if batch is not None:
            inputs, target, _ = task.unpack(to_device(batch, ctx.device))
        with autocast():
            output = call_model(model, inputs)
        if batch is not None:
            evaluator.update(output, target)
    model.train(was_training)
    return evaluator.compute(ctx), evaluator


def _passes(batches, ctx):
    """Sharded (fsdp/hsdp), each forward pass gathers parameters from every rank: a rank whose shard has a batch
    fewer repeats its last one, unscored (None among its passes), so that all make as many passes. A stream's
    batches are agreed batch by batch (one all-reduce each: the length of a stream's shard is known only at its
    end)."""
    count = size(batches)
    if count is not None:
        most = int(ctx.all_reduce(torch.tensor([float(count)], device=ctx.device), "max").item())
        yield from itertools.chain(batches, [None] * (most - count))
        return
    batches = iter(batches)
    while True:
        batch = next(batches, None)
        if ctx.all_reduce(torch.tensor([float(batch is not None)], device=ctx.device), "max").item() == 0:
            return
        yield batch
