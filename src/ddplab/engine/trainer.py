"""The training loop: a stateful object that reads top to bottom.

fit() = resume -> [train an epoch -> evaluate -> record -> snapshot] until done -> test.
Every number it records is global: per-rank sums are all-reduced, never averaged blindly.
"""

from __future__ import annotations

import contextlib
import gc
import math
import random
import resource
import time
from dataclasses import asdict, dataclass, field
from itertools import islice

import numpy as np
import torch
from torch.utils.data import DataLoader

from ddplab.config import Config, parse_duration
from ddplab.data.sampler import ResumableDistributedSampler, ShardSampler
from ddplab.distributed import DistContext, unwrap, wrap_model
from ddplab.engine.checkpoint import Checkpointer
from ddplab.engine.optim import Schedule, build_optimizer, scaled_lr
from ddplab.engine.tasks import call_model, make_task, to_device
from ddplab.errors import UserError
from ddplab.metrics.run_folder import RunFolder


@dataclass
class TrainState:
    """Everything about progress that a snapshot must bring back."""

    epoch: int = 0  # epochs fully completed
    step: int = 0  # optimizer steps taken
    consumed: int = 0  # samples of the current epoch's global order already trained on
    elapsed: float = 0.0  # training seconds, across restarts
    best_val_loss: float = math.inf
    best_epoch: int | None = None
    epoch_loss_sum: float = 0.0  # global, for the epoch in progress
    epoch_samples: float = 0.0
    epoch_tokens: float = 0.0
    epoch_time: float = 0.0
    history: list = field(default_factory=list)  # one dict per epoch
    steps: list = field(default_factory=list)  # one dict per log interval
    stop_reason: str | None = None


def batch_arithmetic(cfg: Config, world_size: int) -> dict:
    """The one place where the global batch is computed."""
    t = cfg.training
    return {"per_process": t.batch_size, "grad_accum_steps": t.grad_accum_steps, "world_size": world_size,
            "global": t.batch_size * t.grad_accum_steps * world_size}


def rng_state() -> dict:
    """This process's random streams as plain lists (gatherable, and safe to load)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state().tolist(),
             "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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
        self.train_loader = self._loader(bundle.train, self.sampler)
        self.steps_per_epoch = math.ceil(len(self.train_loader) / t.grad_accum_steps)
        total = t.max_steps or self.steps_per_epoch * t.epochs
        self.scheduler = Schedule(self.optimizer, t, total)
        self.budget = parse_duration(t.time_budget, "training.time_budget")
        self.state = TrainState()
        from ddplab.metrics.gpu import GpuMonitor

        self.gpu_monitor = GpuMonitor(ctx.device) if ctx.is_main else None
        self.checkpoints = Checkpointer(run.path / "checkpoints", ctx.is_main, cfg.checkpoint.keep_last)
        self._bad_step = torch.full((), -1, dtype=torch.long, device=ctx.device)
        self._interval = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # loss sum, samples, tokens since last log

    # ------------------------------------------------------------------ setup helpers
    def _loader(self, dataset, sampler) -> DataLoader:
        d = self.cfg.data
        return DataLoader(
            dataset, batch_size=self.cfg.training.batch_size, sampler=sampler, collate_fn=self.bundle.collate_fn,
            num_workers=d.num_workers, persistent_workers=d.num_workers > 0,
            pin_memory=d.pin_memory and self.ctx.device.type == "cuda",
            # Its own generator: creating an iterator must not consume the global RNG, or a
            # run resumed mid-epoch would draw different dropout masks than an unbroken one.
            generator=torch.Generator().manual_seed(self.cfg.experiment.seed),
        )

    def _eval_loader(self, dataset) -> DataLoader:
        sampler = ShardSampler(len(dataset), self.ctx.rank, self.ctx.world_size)
        return DataLoader(dataset, batch_size=self.cfg.training.batch_size, sampler=sampler,
                          collate_fn=self.bundle.collate_fn, num_workers=self.cfg.data.num_workers,
                          pin_memory=self.cfg.data.pin_memory and self.ctx.device.type == "cuda")

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=self.autocast_dtype)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> TrainState:
        t, s = self.cfg.training, self.state
        self.resume()
        self.run.log(f"world size {self.ctx.world_size} ({self.ctx.launch.launcher}, backend {self.ctx.backend or 'none'}, "
                     f"device {self.ctx.device}); global batch = {self.batch['per_process']} per process x "
                     f"{self.batch['grad_accum_steps']} accumulation x {self.batch['world_size']} processes = "
                     f"{self.batch['global']}; lr {self.lr:g}; {self.steps_per_epoch} steps per epoch")
        while s.epoch < t.epochs and s.stop_reason is None:
            self.train_epoch()
            epoch_done = s.consumed == 0
            row = self.end_of_epoch(partial=not epoch_done)
            self.snapshot()
            if not epoch_done:
                break
            self.run.log(self._format_row(row))
        if s.stop_reason is None:
            s.stop_reason = "epochs"
        return s

    def train_epoch(self) -> None:
        t, s = self.cfg.training, self.state
        self.sampler.set_epoch(s.epoch, start=s.consumed)
        batches = iter(self.train_loader)
        start = time.perf_counter()
        progress = self._progress(len(self.sampler))
        while True:
            micro = list(islice(batches, t.grad_accum_steps))
            if not micro:
                break
            self.train_step(micro)
            now = time.perf_counter()
            s.elapsed += now - start
            s.epoch_time += now - start
            start = now
            if progress:
                progress.update(progress.task_ids[0], advance=sum(len(b[1]) for b in micro))
            if s.step % self.cfg.logging.log_every == 0:
                self.log_interval(progress)
            if self.cfg.checkpoint.every and s.step % self.cfg.checkpoint.every == 0:
                self.snapshot()
            if self.cfg.training.eval_every and s.step % self.cfg.training.eval_every == 0:
                self.run.log(f"step {s.step}: " + self._format_metrics(self.evaluate(self.bundle.val, "val")))
            if self._should_stop():
                break
        if progress:
            progress.stop()
        if s.stop_reason is None:
            s.consumed = 0  # the epoch ran to its end

    def train_step(self, micro: list) -> None:
        """One optimizer step over `micro` batches, syncing gradients only on the last."""
        s = self.state
        n = len(micro)
        # loss sum, samples, tokens: summed on the device, reduced once per log interval.
        counts = torch.zeros(3, dtype=torch.float64, device=self.ctx.device)
        for i, (inputs, target) in enumerate(micro):
            inputs, target = to_device(inputs, self.ctx.device), to_device(target, self.ctx.device)
            last = i == n - 1
            sync = contextlib.nullcontext() if last or not self.ctx.is_distributed else self.model.no_sync()
            with sync:
                with self._autocast():
                    loss = self.task.loss(call_model(self.model, inputs), target)
                self.scaler.scale(loss / n).backward()
            counts[0] += loss.detach().double() * len(target)
            counts[1] += len(target)
            counts[2] += self.task.tokens(inputs, target)
        loss_sum = counts[0]
        if self.cfg.training.clip_grad_norm:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.raw.parameters(), self.cfg.training.clip_grad_norm)
        if self.cfg.training.nonfinite == "skip" and not self._all_finite(loss_sum):
            self.run.log(f"step {s.step + 1}: non-finite loss on some rank; step skipped")
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.update() if self.scaler.is_enabled() else None
        else:
            self._bad_step = torch.where((self._bad_step < 0) & ~torch.isfinite(loss_sum),
                                         torch.full_like(self._bad_step, s.step + 1), self._bad_step)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        s.step += 1
        s.consumed += sum(len(b[1]) for b in micro) * self.ctx.world_size
        self._interval += counts

    def _all_finite(self, loss_sum: torch.Tensor) -> bool:
        flag = (~torch.isfinite(loss_sum)).float().reshape(1)
        return self.ctx.all_reduce(flag, "max").item() == 0

    def log_interval(self, progress=None) -> None:
        """Reduce the train loss since the last log: the only host sync of the loop."""
        s = self.state
        bad = self.ctx.all_reduce(self._bad_step.clone().float().reshape(1), "max").item()
        if bad >= 0:
            raise NonFiniteLoss(f"non-finite loss at step {int(bad)} (training.nonfinite=stop); "
                                f"lower training.lr or enable training.clip_grad_norm")
        loss_sum, samples, tokens = self.ctx.all_reduce(self._interval.clone()).tolist()
        self._interval.zero_()
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
        s, t = self.state, self.cfg.training
        if t.max_steps and s.step >= t.max_steps:
            s.stop_reason = "max_steps"
        elif self.budget is not None:
            # Clocks differ between ranks: agree, or one rank would wait forever for another.
            over = torch.tensor([float(s.elapsed >= self.budget)], device=self.ctx.device)
            if self.ctx.all_reduce(over, "max").item() > 0:
                s.stop_reason = "time_budget"
        return s.stop_reason is not None

    def end_of_epoch(self, partial: bool) -> dict:
        s = self.state
        self.log_interval()
        tokens = s.epoch_tokens
        t0 = time.perf_counter()
        val = self.evaluate(self.bundle.val, "val")
        eval_time = time.perf_counter() - t0
        peak = self.ctx.all_reduce(torch.tensor([peak_memory_mb(self.ctx.device)], device=self.ctx.device), "max").item()
        epoch_time = s.epoch_time
        row = {"epoch": s.epoch + 1, "step": s.step,
               "train_loss": s.epoch_loss_sum / s.epoch_samples if s.epoch_samples else None,
               **{f"val_{k}": v for k, v in val.items() if k != "samples"},
               "epoch_time_s": epoch_time, "eval_time_s": eval_time, "elapsed_s": s.elapsed,
               "samples_per_s": s.epoch_samples / epoch_time if epoch_time else None,
               "tokens_per_s": tokens / epoch_time if epoch_time and tokens else None,
               "lr": self.scheduler.get_last_lr()[0], "peak_mem_mb": peak}
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
        s.epoch_loss_sum = s.epoch_samples = s.epoch_tokens = s.epoch_time = 0.0
        return row

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, dataset, split: str) -> dict:
        if dataset is None or len(dataset) == 0:
            return {}
        model = self.raw
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
        rngs = self.ctx.gather_objects(rng_state())
        s = self.state
        if self.ctx.is_main:
            state = {"model": self.raw.state_dict(), "optimizer": self.optimizer.state_dict(),
                     "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                     "trainer": asdict(s), "rng": rngs, "world_size": self.ctx.world_size,
                     "config": self.cfg.to_dict(), "meta": self.bundle.meta}
            self.checkpoints.save_snapshot(state, s.step, {"step": s.step, "epoch": s.epoch, "consumed": s.consumed,
                                                           "world_size": self.ctx.world_size})
        self.ctx.barrier()

    def resume(self) -> None:
        how = self.cfg.checkpoint.resume
        if how == "never":
            return
        self.checkpoints.clean_incomplete()
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
        if snap["world_size"] == self.ctx.world_size:
            set_rng_state(snap["rng"][self.ctx.rank])
        else:
            # Other world size: the remaining samples are re-divided (see the sampler);
            # per-rank random streams cannot carry over, so they are reseeded.
            seed_everything(self.cfg.experiment.seed + 1000 * self.state.step + self.ctx.rank)
        self.run.log(f"resumed from {where} (epoch {self.state.epoch + 1}, step {self.state.step}, "
                     f"{self.state.consumed} samples into the epoch)")

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
        for name in ("model", "optimizer", "scheduler", "scaler", "raw", "train_loader", "hooks", "gpu_monitor"):
            if hasattr(self, name):
                delattr(self, name)
        gc.collect()


class NonFiniteLoss(UserError):
    """Training diverged; exit 2 with the step named."""
