"""The training loop: a stateful object that reads top to bottom.

fit() = resume -> [train an epoch -> evaluate -> record -> snapshot] until done.
It steps, accumulates, evaluates and stops; everything else (rows' extra columns, files,
console, progress) hangs on callbacks (engine/callbacks.py), which see a read-only TrainView.
Every number it records is global: per-rank sums are all-reduced, never averaged blindly.

Stops are agreed by all ranks after a step (max_steps, time budget, SIGTERM/SIGUSR1), so
they all snapshot the same step; state_dict() / load_state_dict() (engine/resume.py) are the
whole contract of a resume.
"""

from __future__ import annotations

import gc
import math
import time
from itertools import islice

import torch

from ddplab.config import Config, batch_arithmetic
from ddplab.config_io import parse_duration
from ddplab.data.sampler import ResumableDistributedSampler
from ddplab.distributed import DistContext
from ddplab.engine.callbacks import CallbackList, TrainView
from ddplab.engine.checkpoint import BEST, Checkpointer, load_file
from ddplab.engine.clock import timed
from ddplab.engine.evaluation import evaluate
from ddplab.engine.ledger import LossLedger
from ddplab.engine.loaders import Loaders
from ddplab.engine.optim import Schedule, build_optimizer, plan_for_budget, scaled_lr
from ddplab.engine.preemption import StopSignals
from ddplab.engine.resume import Resumable, TrainState
from ddplab.engine.run_folder import RunFolder
from ddplab.engine.setup import autocast, distribute
from ddplab.engine.sharding import full_state, load_full, micro_step
from ddplab.errors import RunError
from ddplab.tasks import call_model, to_device


class Trainer(Resumable):
    """Outside engine/, a run is driven through fit() / test() / end() / close(), saved and restored
    through state_dict() / load_state_dict(), and observed through `view` (what callbacks get)."""

    def __init__(self, cfg: Config, ctx: DistContext, data, model: torch.nn.Module, run: RunFolder,
                 callbacks=()) -> None:
        self.cfg, self.ctx, self.data, self.run = cfg, ctx, data, run
        t = cfg.training
        self.task = data.task
        self.batch = batch_arithmetic(t.batch_size, t.grad_accum_steps, ctx.world_size, len(data.train))
        self.raw = model
        self.model, self.comm = distribute(model, cfg, ctx)
        self.lr = scaled_lr(t.lr, t.lr_scaling, ctx.world_size)
        self.optimizer = build_optimizer(self.raw, t, self.lr, ctx.device)
        self.autocast = autocast(t.amp, ctx.device)
        self.scaler = torch.amp.GradScaler("cuda", enabled=t.amp == "fp16" and ctx.device.type == "cuda")
        self.sampler = ResumableDistributedSampler(data.train, ctx.world_size, ctx.rank, shuffle=True,
                                                   seed=cfg.experiment.seed)
        self.loaders = Loaders(cfg, ctx, data.collate_fn)
        self.train_loader = None  # made in fit(), after the callbacks' on_train_start
        self.scheduler = Schedule(self.optimizer, t, t.max_steps or self.batch["steps_per_epoch"] * t.epochs)
        self.budget = parse_duration(t.time_budget, "training.time_budget")
        self.state = TrainState()
        self.checkpoints = Checkpointer(run.path / RunFolder.CHECKPOINTS, ctx.is_main, cfg.checkpoint.keep_last)
        self.signals = StopSignals()
        self.callbacks = CallbackList(callbacks)
        self.view = TrainView(self)
        self.evaluator = None  # the last evaluation's (the view hands it to the class report)
        self.ledger = LossLedger(cfg.logging.log_every * t.grad_accum_steps, ctx.device)
        self.phase = "train"  # train | epoch_end | test: where an evaluation was asked for
        self.last_step_samples = 0  # this rank's samples in the last step
        self.activity = "train"  # train | eval | snapshot: what the loop is doing now
        self._resumed = False
        self._mark = time.perf_counter()

    # ------------------------------------------------------------------ the loop
    def fit(self) -> TrainState:
        if not self._resumed:
            self.resume()
        t, s = self.cfg.training, self.state
        self.callbacks.on_train_start(self.view)
        self.train_loader = self.loaders.train(self.data.train, self.sampler)
        self.signals.install()
        self._mark = time.perf_counter()
        try:
            if t.max_steps and s.step >= t.max_steps:
                s.stop_reason = "max_steps"
            while s.epoch < t.epochs and s.stop_reason is None:
                if self.train_epoch():
                    self.end_of_epoch()
                    self.snapshot()
                else:
                    self.stop_mid_epoch()
            self.checkpoints.wait()  # a background snapshot is complete before the run goes on or ends
        finally:
            self.signals.restore()
        if s.stop_reason is None:
            s.stop_reason = "epochs"
        return s

    def train_epoch(self) -> bool:
        """Train until the epoch ends (True) or a stop is agreed (False)."""
        t, s = self.cfg.training, self.state
        self.sampler.set_epoch(s.epoch, start=s.consumed)
        # Worker seeds come from the loader's own generator: a function of the epoch only,
        # so a resumed epoch hands its workers the same seeds.
        self.train_loader.generator.manual_seed(self.cfg.experiment.seed + s.epoch)
        batches = iter(self.train_loader)
        left = len(self.sampler)  # samples still to come on this rank
        self.callbacks.on_epoch_start(self.view)
        while left > 0:
            waited = time.perf_counter()
            self.ctx.beat.mark("data", s.step + 1)
            micro = list(islice(batches, t.grad_accum_steps))
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
            self._tick()  # after the log interval's sync: the time budget sees the device's work
            if self._should_stop():
                break
        if left > 0 and s.stop_reason is not None:
            return False
        s.consumed = 0
        return True

    def train_step(self, micro: list) -> None:
        """One optimizer step over `micro` batches, syncing gradients only on the last."""
        s, t, n, mark = self.state, self.cfg.training, len(micro), self.ctx.beat.mark
        step = s.step + 1
        for i, (inputs, target) in enumerate(micro):
            inputs, target = to_device(inputs, self.ctx.device), to_device(target, self.ctx.device)
            with micro_step(self.model, last=i == n - 1):
                mark("forward")
                with self.autocast():
                    loss = self.task.loss(call_model(self.model, inputs), target)
                mark("backward")
                self.scaler.scale(loss / n if n > 1 else loss).backward()
            self.ledger.add(loss, len(target), self.task.tokens(inputs, target), step)
        mark("optimizer")
        if t.clip_grad_norm:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.raw.parameters(), t.clip_grad_norm)
        # Every rank agrees (reduced flag), so all skip the same step and stay identical. A non-finite
        # loss under training.nonfinite=stop is found by the ledger at the next log interval.
        skip = t.nonfinite == "skip" and not self._all_finite(self.ledger.step_loss(step))
        if skip:
            self.run.log(f"step {step}: non-finite loss on some rank; step skipped (training.nonfinite=skip)")
            self.ledger.drop_step(step)
        if not skip or self.scaler.is_enabled():  # the scaler skips non-finite gradients itself and lowers its scale
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.last_step_samples = sum(len(b[1]) for b in micro)
        s.step = step
        s.consumed += self.last_step_samples * self.ctx.world_size

    def _all_finite(self, loss_sum: torch.Tensor) -> bool:
        flag = (~torch.isfinite(loss_sum)).float().reshape(1)
        return self.ctx.all_reduce(flag, "max").item() == 0

    def log_interval(self) -> None:
        """Reduce the train loss since the last log: the only host sync of the loop."""
        s = self.state
        sums, first_bad = self.ledger.totals()
        bad = self.ctx.all_reduce(first_bad, "min").item()
        if math.isfinite(bad):
            raise RunError(f"non-finite loss at step {int(bad)} (every micro-batch's loss on every rank, checked "
                           f"as the train loss is logged, each logging.log_every={self.cfg.logging.log_every} steps; "
                           f"training.nonfinite=stop): lower training.lr, set training.clip_grad_norm, or "
                           f"training.nonfinite=skip to skip such steps")
        loss_sum, samples, tokens = self.ctx.all_reduce(sums).tolist()
        if samples == 0:
            return
        s.epoch_loss_sum += loss_sum
        s.epoch_samples += samples
        s.epoch_tokens += tokens
        values = {"loss": loss_sum / samples, "lr": self.scheduler.get_last_lr()[0]}
        s.steps.append({"step": s.step, "epoch": s.epoch + 1, **values, "elapsed_s": s.elapsed})
        # With a time budget the schedule is planned over the steps the budget allows, re-estimated
        # here, where all ranks meet anyway (the slowest rank's clock counts).
        plan_for_budget(self.scheduler, self.ctx, s.step, s.elapsed, self.budget)
        self.callbacks.on_log(self.view, values)

    def _should_stop(self) -> bool:
        """Agree on stopping after this step: every rank must stop at the same step, or one
        would wait forever in a collective for another."""
        s, t = self.state, self.cfg.training
        if t.max_steps and s.step >= t.max_steps:
            s.stop_reason = "max_steps"  # the same on every rank without asking
            return True
        if s.step % self.cfg.logging.log_every:
            # Asking every step would put a collective and a host sync in every step; the
            # log interval is a schedule all ranks share, and where the loop syncs anyway.
            return False
        over = self.budget is not None and s.elapsed >= self.budget
        flags = torch.tensor([float(over), float(self.signals.received is not None)], device=self.ctx.device)
        over, signalled = self.ctx.all_reduce(flags, "max").tolist()
        if signalled:
            s.stop_reason = "preempted"
            self.run.log(f"stop signal ({self.signals.received or 'on another rank'}) after step {s.step}: "
                         f"snapshotting and exiting")
        elif over:
            s.stop_reason = "time_budget"
            self.run.log(f"time budget {t.time_budget} reached after step {s.step} ({s.elapsed:.1f} s spent)")
        return s.stop_reason is not None

    def stop_mid_epoch(self) -> None:
        """Snapshot where the stop happened; then (unless pre-empted) evaluate and record it."""
        s = self.state
        self.snapshot()
        self.run.log(f"stopped ({s.stop_reason}) after step {s.step}, {s.consumed} samples into epoch {s.epoch + 1}; "
                     f"snapshot saved")
        if s.stop_reason != "preempted":
            # A row for the part-epoch, after the snapshot: a resumed run finishes the epoch
            # from the snapshot's sums, so metrics.csv never holds the epoch twice.
            self.end_of_epoch(partial=True)

    def end_of_epoch(self, partial: bool = False) -> dict:
        """The epoch's core row (global numbers); callbacks add columns and record it."""
        s, ctx = self.state, self.ctx
        self.log_interval()
        self.phase = "epoch_end"
        val = self.evaluate(self.data.val, "val")
        self.phase = "train"
        # The slowest rank's wait is what holds the others at the next all-reduce.
        data_wait = ctx.all_reduce(torch.tensor([s.epoch_data_wait], device=ctx.device), "max").item()
        self._tick()
        took = s.epoch_time - s.epoch_eval_time - s.epoch_snapshot_time  # the clock's rest: training
        row = {"epoch": s.epoch + 1, "step": s.step,
               "train_loss": s.epoch_loss_sum / s.epoch_samples if s.epoch_samples else None,
               **{f"val_{k}": v for k, v in val.items() if k != "samples"},
               "epoch_time_s": took, "eval_time_s": s.epoch_eval_time, "snapshot_time_s": s.epoch_snapshot_time,
               "elapsed_s": s.elapsed,
               "samples_per_s": s.epoch_samples / took if took else None,
               "tokens_per_s": s.epoch_tokens / took if took and s.epoch_tokens else None,
               "lr": self.scheduler.get_last_lr()[0], "data_wait_s": data_wait}
        if partial:
            row["partial"] = True
        s.history.append(row)
        self.callbacks.on_epoch_end(self.view, row)
        improved = bool(val) and val["loss"] < s.best_val_loss
        if improved:
            s.best_val_loss, s.best_epoch = val["loss"], s.epoch + 1
        if not partial:
            s.epoch += 1
            # A stopped epoch keeps its sums: a resumed run finishes the same epoch's numbers. The clock runs on:
            # what follows this row (its files, the best model, the snapshot) is counted in the next epoch's.
            s.epoch_loss_sum = s.epoch_samples = s.epoch_tokens = s.epoch_data_wait = s.epoch_time = 0.0
            s.epoch_eval_time = s.epoch_snapshot_time = 0.0
        if self.cfg.checkpoint.save_best and (not val or improved):
            with timed(self, "snapshot"):
                self.checkpoints.save_best(full_state(self.raw), self.cfg, self.data, row["epoch"], s.step, val_loss=val.get("loss"))
        return row

    def _tick(self) -> None:
        """One continuous clock: the epoch's wall time and the run's elapsed time lose nothing between ticks."""
        now = time.perf_counter()
        self.state.elapsed += now - self._mark
        self.state.epoch_time += now - self._mark
        self._mark = now

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, dataset, split: str) -> dict:
        if dataset is None or len(dataset) == 0:
            return {}
        with timed(self, "eval"):
            metrics, self.evaluator = evaluate(self.raw, self.task, self.loaders.evaluation(dataset), self.ctx,
                                               self.autocast)
            self.callbacks.on_eval_end(self.view, split, metrics)
        return metrics

    def test(self) -> dict:
        """The best model (by validation loss; the last one without it) on the test split."""
        if self.data.test is None:
            return {}
        self.ctx.barrier()
        if (best := self.checkpoints.root / BEST).is_file():
            load_full(self.raw, load_file(best)["model"])
        self.phase = "test"
        return self.evaluate(self.data.test, "test")

    def end(self, summary: dict) -> None:
        """The run is recorded: callbacks' on_train_end."""
        self.callbacks.on_train_end(self.view, summary)

    def close(self) -> None:
        """Drop the DDP model and optimizer before the process group goes (gloo aborts otherwise)."""
        for name in ("model", "optimizer", "scheduler", "scaler", "raw", "train_loader", "loaders", "comm", "evaluator"):
            if hasattr(self, name):
                delattr(self, name)
        gc.collect()
