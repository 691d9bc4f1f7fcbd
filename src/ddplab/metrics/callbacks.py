"""ddplab's own callbacks: the columns an epoch row gains beyond the loop's core numbers, the
files and console lines it becomes, and the progress bar."""

from __future__ import annotations

import resource
import sys

import torch

from ddplab.engine.callbacks import Callback


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class PeakMemory(Callback):
    """peak_mem_mb: the largest of any rank (a collective: every rank takes part)."""

    def on_epoch_end(self, trainer, row):
        ctx = trainer.ctx
        row["peak_mem_mb"] = ctx.all_reduce(torch.tensor([peak_memory_mb(ctx.device)], device=ctx.device), "max").item()


class ModelFlops(Callback):
    """mfu: model FLOPs utilisation, where the device's peak and the model's FLOPs are known."""

    def on_epoch_end(self, trainer, row):
        from ddplab.metrics.throughput import mfu

        value = mfu(trainer.raw, row.get("tokens_per_s"), trainer.ctx.device, trainer.ctx.world_size)
        if value is not None:
            row["mfu"] = value


class CommColumns(Callback):
    """comm_time_s / compute_time_s from the gradient all-reduce monitor (distributed runs)."""

    timer = None

    def on_train_start(self, trainer):
        from ddplab.engine.comm import attach_step_timer

        self.timer = attach_step_timer(trainer.raw, trainer.comm, trainer.cfg)  # forward/backward time for `ddplab forecast`

    def on_epoch_end(self, trainer, row):
        from ddplab.engine.comm import epoch_comm_row

        row.update(epoch_comm_row(trainer.comm, trainer.ctx, row["epoch_time_s"], self.timer))


class GpuColumns(Callback):
    """gpu_util / gpu_mem_mb sampled through NVML on rank 0 (nothing without a GPU)."""

    def __init__(self) -> None:
        self.monitor = None

    def on_train_start(self, trainer):
        if trainer.ctx.is_main and trainer.ctx.device.type == "cuda" and self.monitor is None:
            from ddplab.metrics.gpu import GpuMonitor

            self.monitor = GpuMonitor(trainer.ctx.device)

    def on_epoch_end(self, trainer, row):
        if self.monitor is not None:
            row.update(self.monitor.take_epoch())

    def on_train_end(self, trainer, summary):
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None


class RunRecorder(Callback):
    """metrics.csv (every epoch so far), TensorBoard scalars, and the console / train.log lines."""

    ROW_KEYS = ("train_loss", "val_loss", "val_accuracy", "val_f1", "val_perplexity", "val_r2", "val_rmse",
                "epoch_time_s", "samples_per_s")

    def on_train_start(self, trainer):
        b = trainer.batch
        trainer.run.log(f"world size {trainer.ctx.world_size} ({trainer.ctx.launch.launcher}, backend "
                        f"{trainer.ctx.backend or 'none'}, device {trainer.ctx.device}); global batch = "
                        f"{b['per_process']} per process x {b['grad_accum_steps']} accumulation x {b['world_size']} "
                        f"processes = {b['global']}; lr {trainer.lr:g}; {trainer.steps_per_epoch} steps per epoch")

    def on_log(self, trainer, values):
        s, every = trainer.state, trainer.cfg.logging.log_every
        trainer.run.scalars("train", values, s.step)
        if not _bar_shown(trainer) and (s.step % (every * 10) == 0 or every == 1):
            trainer.run.log(f"epoch {s.epoch + 1} step {s.step}: loss {values['loss']:.4f} lr {values['lr']:.3e}")

    def on_eval_end(self, trainer, split, metrics):
        if split == "val" and trainer.cfg.training.eval_every and trainer.state.step % trainer.cfg.training.eval_every == 0 \
                and trainer.phase == "train":
            trainer.run.log(f"step {trainer.state.step}: " + format_metrics(metrics))

    def on_epoch_end(self, trainer, row):
        run, step = trainer.run, trainer.state.step
        run.write_epochs(trainer.state.history)
        run.scalars("val", {k[4:]: v for k, v in row.items() if k.startswith("val_")}, step)
        run.scalars("epoch", {k: row[k] for k in ("epoch_time_s", "samples_per_s", "peak_mem_mb") if row.get(k)}, step)
        head = f"epoch {row['epoch']}"
        if row.get("partial"):  # a run stopped mid-epoch (max_steps, time budget): say how far it got
            head += f" (partial, {row['step'] - (row['epoch'] - 1) * trainer.steps_per_epoch}/{trainer.steps_per_epoch} steps)"
        run.log(f"{head}: " + ", ".join(f"{k} {row[k]:.4g}" for k in self.ROW_KEYS if row.get(k) is not None))


def format_metrics(m: dict) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in m.items() if isinstance(v, float))


def _bar_shown(trainer) -> bool:
    return trainer.ctx.is_main and trainer.cfg.logging.progress and sys.stdout.isatty()


class ProgressBar(Callback):
    """A rich progress bar on rank 0, in terminals only (train.log gets the periodic lines instead)."""

    def __init__(self) -> None:
        self.progress = None

    def on_epoch_start(self, trainer):
        if not _bar_shown(trainer):
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeRemainingColumn(), console=trainer.run.console, transient=True)
        left = len(trainer.sampler) * trainer.ctx.world_size
        self.progress.add_task(f"epoch {trainer.state.epoch + 1}", total=left)
        self.progress.start()

    def on_step_end(self, trainer):
        if self.progress is not None:
            self.progress.update(self.progress.task_ids[0], advance=trainer.last_step_samples * trainer.ctx.world_size)

    def on_log(self, trainer, values):
        if self.progress is not None:
            self.progress.update(self.progress.task_ids[0], description=f"epoch {trainer.state.epoch + 1} "
                                 f"loss {values['loss']:.4f} lr {values['lr']:.2e}")

    def on_epoch_end(self, trainer, row):
        self._stop()

    def on_train_end(self, trainer, summary):
        self._stop()

    def _stop(self):
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def column_callbacks() -> list[Callback]:
    """The columns ddplab adds to every epoch row; they run before user callbacks and the recorder."""
    return [PeakMemory(), ModelFlops(), CommColumns(), GpuColumns(), ProgressBar()]
