"""The training loop: a stateful object that reads top to bottom.

fit() = resume -> [train an epoch -> evaluate -> record -> snapshot] until done -> test.
Every number it records is global: per-rank sums are all-reduced, never averaged blindly.

Stops are agreed by all ranks after a step (max_steps, time budget, SIGTERM/SIGUSR1), so
they all snapshot the same step; a snapshot holds everything needed to continue exactly
(weights, optimizer, schedule, scaler, position in the epoch, every rank's RNG streams).
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import resource
import time
from dataclasses import asdict, dataclass, field
from itertools import islice

import torch
from torch.utils.data import DataLoader

from ddplab.config import Config, parse_duration
from ddplab.data.sampler import ResumableDistributedSampler, ShardSampler
from ddplab.distributed import DistContext, wrap_model
from ddplab.engine import faults
from ddplab.engine.checkpoint import Checkpointer
from ddplab.engine.ledger import LossLedger
from ddplab.engine.optim import Schedule, build_optimizer, scaled_lr
from ddplab.engine.preemption import StopSignals
from ddplab.engine.rng import rng_state, seed_everything, set_rng_state
from ddplab.engine.tasks import call_model, make_task, to_device
from ddplab.errors import UserError
from ddplab.metrics.run_folder import RunFolder
from ddplab.metrics.throughput import mfu


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
    epoch_time: float = 0.0
    epoch_data_wait: float = 0.0  # seconds this rank waited for its next batch
    history: list = field(default_factory=list)  # one dict per epoch
    steps: list = field(default_factory=list)  # one dict per log interval
    stop_reason: str | None = None  # epochs | max_steps | time_budget | preempted
    resumes: int = 0  # how many times this run was resumed from a snapshot


def batch_arithmetic(cfg: Config, world_size: int) -> dict:
    """The one place where the global batch is computed."""
    t = cfg.training
    return {"per_process": t.batch_size, "grad_accum_steps": t.grad_accum_steps, "world_size": world_size,
            "global": t.batch_size * t.grad_accum_steps * world_size}


def data_workers(requested: int | None, device: torch.device, processes_per_node: int) -> int:
    """data.num_workers, or by default none on CPU (the ranks already use every core) and up to
    4 per process on CUDA, where loading batches in the training process leaves the GPU waiting."""
    if requested is not None:
        return requested
    if device.type != "cuda":
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(0, min(4, cores // processes_per_node - 1))


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class Trainer:
    def __init__(self, cfg: Config, ctx: DistContext, bundle, model: torch.nn.Module, run: RunFolder) -> None:
        self.cfg, self.ctx, self.bundle, self.run = cfg, ctx, bundle, run
        t = cfg.training
        self.task = make_task(bundle)
        self.batch = batch_arithmetic(cfg, ctx.world_size)
        self.raw = model
        self.model = wrap_model(model, ctx, bucket_cap_mb=cfg.distributed.bucket_cap_mb,
                                find_unused_parameters=cfg.distributed.find_unused_parameters or cfg.model.freeze)
        self.hooks = None
        if ctx.is_distributed:
            from ddplab.engine.comm import install_comm_hook

            self.hooks = install_comm_hook(self.model, cfg.distributed, ctx)
        if t.compile:
            self.model = torch.compile(self.model)
        self.lr = scaled_lr(t.lr, t.lr_scaling, ctx.world_size)
        self.optimizer = build_optimizer(self.raw, t, self.lr, ctx.device)
        self.autocast_dtype = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}[t.amp]
        self.scaler = torch.amp.GradScaler("cuda", enabled=t.amp == "fp16" and ctx.device.type == "cuda")

        self.sampler = ResumableDistributedSampler(bundle.train, ctx.world_size, ctx.rank, shuffle=True,
                                                   seed=cfg.experiment.seed)
        self.faults = faults.current()  # test-only hooks; no-ops unless DDPLAB_FAULT is set
        self.data_workers = data_workers(cfg.data.num_workers, ctx.device, ctx.launch.local_world_size)
        self._eval_loaders: dict[int, DataLoader] = {}
        self.train_loader = self._loader(bundle.train, self.faults.traced(self.sampler))
        self.steps_per_epoch = math.ceil(len(self.train_loader) / t.grad_accum_steps)
        total = t.max_steps or self.steps_per_epoch * t.epochs
        self.scheduler = Schedule(self.optimizer, t, total)
        self.budget = parse_duration(t.time_budget, "training.time_budget")
        self.state = TrainState()
        from ddplab.metrics.gpu import GpuMonitor

        self.gpu_monitor = GpuMonitor(ctx.device) if ctx.is_main else None
        self.checkpoints = Checkpointer(run.path / "checkpoints", ctx.is_main, cfg.checkpoint.keep_last)
        self.signals = StopSignals()
        self._resumed = False
        self._mark = time.perf_counter()
        self.ledger = LossLedger(cfg.logging.log_every * t.grad_accum_steps, ctx.device)

    # ------------------------------------------------------------------ setup helpers
    def _loader(self, dataset, sampler) -> DataLoader:
        workers = self.data_workers
        return DataLoader(
            dataset, batch_size=self.cfg.training.batch_size, sampler=sampler, collate_fn=self.bundle.collate_fn,
            num_workers=workers, persistent_workers=workers > 0,
            pin_memory=self.cfg.data.pin_memory and self.ctx.device.type == "cuda",
            # Its own generator: creating an iterator must not consume the global RNG, or a
            # run resumed mid-epoch would draw different dropout masks than an unbroken one.
            generator=torch.Generator().manual_seed(self.cfg.experiment.seed),
        )

    def _eval_loader(self, dataset) -> DataLoader:
        """One loader per split, kept: its workers persist instead of starting at every evaluation."""
        if id(dataset) not in self._eval_loaders:
            sampler = ShardSampler(len(dataset), self.ctx.rank, self.ctx.world_size)
            workers = self.data_workers
            self._eval_loaders[id(dataset)] = DataLoader(
                dataset, batch_size=self.cfg.training.batch_size, sampler=sampler, collate_fn=self.bundle.collate_fn,
                num_workers=workers, persistent_workers=workers > 0,
                pin_memory=self.cfg.data.pin_memory and self.ctx.device.type == "cuda")
        return self._eval_loaders[id(dataset)]

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=self.autocast_dtype)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> TrainState:
        if not self._resumed:
            self.resume()
        t, s = self.cfg.training, self.state
        self.run.log(f"world size {self.ctx.world_size} ({self.ctx.launch.launcher}, backend {self.ctx.backend or 'none'}, "
                     f"device {self.ctx.device}); global batch = {self.batch['per_process']} per process x "
                     f"{self.batch['grad_accum_steps']} accumulation x {self.batch['world_size']} processes = "
                     f"{self.batch['global']}; lr {self.lr:g}; {self.steps_per_epoch} steps per epoch")
        self.signals.install()
        self._mark = time.perf_counter()
        try:
            if t.max_steps and s.step >= t.max_steps:
                s.stop_reason = "max_steps"
            while s.epoch < t.epochs and s.stop_reason is None:
                if self.train_epoch():
                    row = self.end_of_epoch()
                    self.snapshot()
                    self.run.log(self._format_row(row))
                else:
                    self.stop_mid_epoch()
        finally:
            self.signals.restore()
        if s.stop_reason is None:
            s.stop_reason = "epochs"
        return s

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

    def _tick(self) -> None:
        now = time.perf_counter()
        self.state.elapsed += now - self._mark
        self._mark = now

    def train_epoch(self) -> bool:
        """Train until the epoch ends (True) or a stop is agreed (False)."""
        t, s = self.cfg.training, self.state
        self.sampler.set_epoch(s.epoch, start=s.consumed)
        # Worker seeds come from the loader's own generator: a function of the epoch only,
        # so a resumed epoch hands its workers the same seeds.
        self.train_loader.generator.manual_seed(self.cfg.experiment.seed + s.epoch)
        batches = iter(self.train_loader)
        left = len(self.sampler)  # samples still to come on this rank
        start = time.perf_counter()
        progress = self._progress(left)
        while left > 0:
            waited = time.perf_counter()
            micro = list(islice(batches, t.grad_accum_steps))
            s.epoch_data_wait += time.perf_counter() - waited
            if not micro:
                break
            self.train_step(micro)
            left -= sum(len(b[1]) for b in micro)
            self.faults.after_step(s.step)
            s.epoch_time += time.perf_counter() - start
            self._tick()
            if progress:
                progress.update(progress.task_ids[0], advance=sum(len(b[1]) for b in micro))
            if s.step % self.cfg.logging.log_every == 0:
                self.log_interval(progress)
            if self.cfg.checkpoint.every and s.step % self.cfg.checkpoint.every == 0:
                self.snapshot()
            if self.cfg.training.eval_every and s.step % self.cfg.training.eval_every == 0:
                self.run.log(f"step {s.step}: " + self._format_metrics(self.evaluate(self.bundle.val, "val")))
            start = time.perf_counter()
            if self._should_stop():
                break
        if self.ctx.device.type == "cuda":
            # Kernels are queued ahead of the host: the epoch's time must include its last steps.
            waited = time.perf_counter()
            torch.cuda.synchronize(self.ctx.device)
            s.epoch_time += time.perf_counter() - waited
        if progress:
            progress.stop()
        if left > 0 and s.stop_reason is not None:
            return False
        s.consumed = 0
        return True

    def train_step(self, micro: list) -> None:
        """One optimizer step over `micro` batches, syncing gradients only on the last."""
        s = self.state
        n = len(micro)
        step = s.step + 1
        for i, (inputs, target) in enumerate(micro):
            inputs, target = to_device(inputs, self.ctx.device), to_device(target, self.ctx.device)
            last = i == n - 1
            sync = contextlib.nullcontext() if last or not self.ctx.is_distributed else self.model.no_sync()
            with sync:
                with self._autocast():
                    loss = self.faults.loss(self.task.loss(call_model(self.model, inputs), target), step)
                self.scaler.scale(loss / n if n > 1 else loss).backward()
            self.ledger.add(loss, len(target), self.task.tokens(inputs, target), step)
        if self.cfg.training.clip_grad_norm:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.raw.parameters(), self.cfg.training.clip_grad_norm)
        if self.cfg.training.nonfinite == "skip" and not self._all_finite(self.ledger.step_loss(step)):
            # Every rank agrees (reduced flag), so all skip the same step and stay identical.
            self.run.log(f"step {step}: non-finite loss on some rank; step skipped (training.nonfinite=skip)")
            if self.scaler.is_enabled():  # the scaler skips non-finite gradients itself and lowers its scale
                self.scaler.step(self.optimizer)
                self.scaler.update()
            self.ledger.drop_step(step)
        else:
            # A non-finite loss (training.nonfinite=stop) is found by the ledger at the next log interval.
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        s.step = step
        s.consumed += sum(len(b[1]) for b in micro) * self.ctx.world_size

    def _all_finite(self, loss_sum: torch.Tensor) -> bool:
        flag = (~torch.isfinite(loss_sum)).float().reshape(1)
        return self.ctx.all_reduce(flag, "max").item() == 0

    def log_interval(self, progress=None) -> None:
        """Reduce the train loss since the last log: the only host sync of the loop."""
        s = self.state
        sums, first_bad = self.ledger.totals()
        bad = self.ctx.all_reduce(first_bad, "min").item()
        if math.isfinite(bad):
            raise NonFiniteLoss(f"non-finite loss at step {int(bad)} (training.nonfinite=stop); "
                                f"lower training.lr or enable training.clip_grad_norm")
        loss_sum, samples, tokens = self.ctx.all_reduce(sums).tolist()
        if samples == 0:
            return
        s.epoch_loss_sum += loss_sum
        s.epoch_samples += samples
        s.epoch_tokens += tokens
        loss, lr = loss_sum / samples, self.scheduler.get_last_lr()[0]
        s.steps.append({"step": s.step, "epoch": s.epoch + 1, "loss": loss, "lr": lr, "elapsed_s": s.elapsed})
        self.run.scalars("train", {"loss": loss, "lr": lr}, s.step)
        if progress:
            progress.update(progress.task_ids[0], description=f"epoch {s.epoch + 1} loss {loss:.4f} lr {lr:.2e}")
        elif s.step % (self.cfg.logging.log_every * 10) == 0 or self.cfg.logging.log_every == 1:
            self.run.log(f"epoch {s.epoch + 1} step {s.step}: loss {loss:.4f} lr {lr:.3e}")

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
            self.run.log(f"time budget {self.cfg.training.time_budget} reached after step {s.step} "
                         f"({s.elapsed:.1f} s spent)")
        return s.stop_reason is not None

    def end_of_epoch(self, partial: bool = False) -> dict:
        s = self.state
        self.log_interval()
        tokens = s.epoch_tokens
        t0 = time.perf_counter()
        val = self.evaluate(self.bundle.val, "val")
        eval_time = time.perf_counter() - t0
        peak = self.ctx.all_reduce(torch.tensor([peak_memory_mb(self.ctx.device)], device=self.ctx.device), "max").item()
        epoch_time = s.epoch_time
        # The slowest rank's wait is what holds the others at the next all-reduce.
        data_wait = self.ctx.all_reduce(torch.tensor([s.epoch_data_wait], device=self.ctx.device), "max").item()
        row = {"epoch": s.epoch + 1, "step": s.step,
               "train_loss": s.epoch_loss_sum / s.epoch_samples if s.epoch_samples else None,
               **{f"val_{k}": v for k, v in val.items() if k != "samples"},
               "epoch_time_s": epoch_time, "eval_time_s": eval_time, "elapsed_s": s.elapsed,
               "samples_per_s": s.epoch_samples / epoch_time if epoch_time else None,
               "tokens_per_s": tokens / epoch_time if epoch_time and tokens else None,
               "lr": self.scheduler.get_last_lr()[0], "peak_mem_mb": peak, "data_wait_s": data_wait}
        utilisation = mfu(self.raw, row["tokens_per_s"], self.ctx.device, self.ctx.world_size)
        if utilisation is not None:
            row["mfu"] = utilisation
        from ddplab.engine.comm import epoch_comm_row

        row.update(epoch_comm_row(self.hooks, self.ctx, epoch_time))
        row.update(self.gpu_monitor.take_epoch() if self.gpu_monitor else {})
        if partial:
            row["partial"] = True
        s.history.append(row)
        self.run.write_epochs(s.history)
        self.run.scalars("val", {k: v for k, v in val.items() if k != "samples"}, s.step)
        self.run.scalars("epoch", {k: row[k] for k in ("epoch_time_s", "samples_per_s", "peak_mem_mb") if row.get(k)}, s.step)
        if val and val["loss"] < s.best_val_loss:
            s.best_val_loss, s.best_epoch = val["loss"], s.epoch + 1
            if self.cfg.checkpoint.save_best:
                self.checkpoints.save_best(self.inference_payload(val_loss=val["loss"]))
        elif not val and self.cfg.checkpoint.save_best:
            self.checkpoints.save_best(self.inference_payload(val_loss=None))
        if not partial:
            s.epoch += 1
            # A stopped epoch keeps its sums: a resumed run finishes the same epoch's numbers.
            s.epoch_loss_sum = s.epoch_samples = s.epoch_tokens = s.epoch_time = s.epoch_data_wait = 0.0
        return row

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, dataset, split: str) -> dict:
        if dataset is None or len(dataset) == 0:
            return {}
        model = self.raw
        # DDP syncs buffers at the start of each training forward, so after the last step every
        # rank holds its own BatchNorm statistics: evaluate all shards with rank 0's, as DDP would.
        self.ctx.broadcast_buffers(model)
        was_training = model.training
        model.eval()
        evaluator = self.task.evaluator(self.ctx.device)
        for inputs, target in self._eval_loader(dataset):
            inputs, target = to_device(inputs, self.ctx.device), to_device(target, self.ctx.device)
            with self._autocast():
                logits = call_model(model, inputs)
            evaluator.update(logits, target)
        model.train(was_training)
        return evaluator.compute(self.ctx)

    def test(self) -> dict:
        """Final evaluation of the best model on the test split, when there is one."""
        if self.bundle.test is None:
            return {}
        return self.evaluate(self.bundle.test, "test")

    # ------------------------------------------------------------------ checkpoints
    def inference_payload(self, **extra) -> dict:
        """What `generate` / `predict` need: weights, config, tokenizer or labels."""
        return {"model": {k: v.detach().cpu() for k, v in self.raw.state_dict().items()},
                "config": self.cfg.to_dict(), "meta": self.bundle.meta, "task": self.bundle.task,
                "num_classes": self.bundle.num_classes, "vocab_size": self.bundle.vocab_size,
                "epoch": self.state.epoch + 1, "step": self.state.step, **extra}

    def snapshot(self) -> None:
        """A collective: every rank hands its RNG state to rank 0, which writes."""
        self.log_interval()
        self._tick()
        rngs = self.ctx.gather_objects(rng_state())
        s = self.state
        if self.ctx.is_main:
            state = {"model": self.raw.state_dict(), "optimizer": self.optimizer.state_dict(),
                     "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                     "trainer": asdict(s), "rng": rngs, "world_size": self.ctx.world_size,
                     "sampler": {"seed": self.sampler.seed, "epoch": s.epoch, "consumed": s.consumed},
                     "config": self.cfg.to_dict(), "meta": self.bundle.meta}
            self.checkpoints.save_snapshot(state, s.step, {"step": s.step, "epoch": s.epoch, "consumed": s.consumed,
                                                           "world_size": self.ctx.world_size})
        self.ctx.barrier()

    def resume(self) -> None:
        """Load the newest complete snapshot (checkpoint.resume=auto) or the one named."""
        self._resumed = True
        how = self.cfg.checkpoint.resume
        if how == "never":
            return
        for name in self.checkpoints.clean_incomplete():
            self.run.log(f"removed incomplete snapshot {name} (a save was interrupted)")
        self.ctx.barrier()
        if how == "auto":
            found = self.checkpoints.load_latest(self.run.log)
            if found is None:
                return
            where, snap = found
        else:
            where, snap = how, self.checkpoints.load_snapshot(how)
        self.raw.load_state_dict(snap["model"])
        self.optimizer.load_state_dict(snap["optimizer"])
        self.scheduler.load_state_dict(snap["scheduler"])
        self.scaler.load_state_dict(snap["scaler"])
        self.state = TrainState(**snap["trainer"])
        self.state.stop_reason = None
        self.state.resumes += 1
        if snap["world_size"] == self.ctx.world_size:
            set_rng_state(snap["rng"][self.ctx.rank])
        else:
            # The remaining samples of the epoch are re-divided among the new ranks (see the
            # sampler); per-rank random streams cannot carry over, so they are reseeded.
            seed_everything(self.cfg.experiment.seed + 1000 * self.state.step + self.ctx.rank)
            self.run.log(f"world size changed from {snap['world_size']} to {self.ctx.world_size}: the rest of epoch "
                         f"{self.state.epoch + 1} is re-divided among {self.ctx.world_size} processes (no sample "
                         f"repeated or lost); dropout streams are reseeded, so the run is no longer bit-identical")
        # Events logged after the snapshot by the attempt that died are dropped from TensorBoard.
        self.run.purge_step = self.state.step + 1
        self.run.log(f"resumed from {where} (epoch {self.state.epoch + 1}, step {self.state.step}, "
                     f"{self.state.consumed} samples into the epoch, {self.state.elapsed:.1f} s already spent)")

    # ------------------------------------------------------------------ presentation
    def _progress(self, total: int):
        import sys

        if not (self.ctx.is_main and self.cfg.logging.progress and sys.stdout.isatty()):
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeRemainingColumn(),
                            console=self.run.console, transient=True)
        progress.add_task(f"epoch {self.state.epoch + 1}", total=total * self.ctx.world_size)
        progress.start()
        return progress

    @staticmethod
    def _format_metrics(m: dict) -> str:
        return ", ".join(f"{k} {v:.4g}" for k, v in m.items() if isinstance(v, float))

    def _format_row(self, row: dict) -> str:
        keys = ("train_loss", "val_loss", "val_accuracy", "val_f1", "val_perplexity", "epoch_time_s", "samples_per_s")
        return f"epoch {row['epoch']}: " + ", ".join(f"{k} {row[k]:.4g}" for k in keys if row.get(k) is not None)

    def close(self) -> None:
        """Drop the DDP model and optimizer before the process group goes (gloo aborts otherwise)."""
        if getattr(self, "gpu_monitor", None):
            self.gpu_monitor.close()
        for name in ("model", "optimizer", "scheduler", "scaler", "raw", "train_loader", "_eval_loaders", "hooks",
                     "gpu_monitor"):
            if hasattr(self, name):
                delattr(self, name)
        gc.collect()


class NonFiniteLoss(UserError):
    """Training diverged; exit 2 with the step named."""
