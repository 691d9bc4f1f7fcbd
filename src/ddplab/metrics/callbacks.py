"""ddplab's own callbacks: the columns an epoch row gains, the files and console lines it becomes, the progress bar."""

from __future__ import annotations

import resource
import sys
import time

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ddplab.callbacks import Callback
from ddplab.config.reading import format_duration
from ddplab.engine.parallel.ddp_comm import attach_step_timer, epoch_comm_row
from ddplab.metrics.gpu import GpuMonitor
from ddplab.metrics.stragglers import Stragglers
from ddplab.metrics.throughput import mfu
from ddplab.runtime import process_state


class EpochColumns(Callback):
    """peak_mem_mb, the largest of any rank (a collective); mfu where known; comm_time_s / compute_time_s
    (distributed runs); gpu_util / gpu_mem_mb sampled on rank 0 while training steps run."""

    timer = monitor = None

    def on_train_start(self, view):
        self.timer = attach_step_timer(view.model, view.comm, view.config)  # compute time for `ddplab forecast`
        if view.is_main and view.device.type == "cuda" and self.monitor is None:
            self.monitor = GpuMonitor(view.device, gate=lambda: view.activity == "train")

    def on_epoch_end(self, view, row):
        device = view.device
        peak = (
            torch.cuda.max_memory_allocated(device) / 2**20
            if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        )  # ru_maxrss: KiB on Linux
        row["peak_mem_mb"] = view.dist.all_reduce(torch.tensor([peak], device=device), "max").item()
        value = mfu(view.model, row.get("tokens_per_s"), device, view.world_size)
        if value is not None:
            row["mfu"] = value
        row.update(epoch_comm_row(view.comm, view.dist, row["epoch_time_s"], self.timer))
        if self.monitor is not None:
            row.update(self.monitor.take_epoch())

    def on_train_end(self, view, summary):
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None


class RunRecorder(Callback):
    """metrics.csv and the console / train.log lines: each epoch's, and the test split's results at the end."""

    keys: tuple = ()

    ROW_KEYS = (
        "train_loss",
        "val_loss",
        "val_accuracy",
        "val_f1",
        "val_perplexity",
        "val_r2",
        "val_rmse",
        "epoch_time_s",
        "samples_per_s",
        "untrained_samples",  # a stream's, left by uneven ranks
    )

    def on_train_start(self, view):
        own = tuple(f"val_{name}" for name in view.data.task.metrics() if f"val_{name}" not in self.ROW_KEYS)
        self.keys = self.ROW_KEYS[:5] + own + self.ROW_KEYS[5:]  # a user Task's metrics before the times
        run, b, dist, d = view.run, view.batch, view.dist, view.config.distributed
        # Replica groups: b["world_size"] counts every group's processes, and a step's batch is what the groups
        # in its quorum make (replicas.csv, and metrics.csv's global_batch), this only with every group present.
        across = (
            f"{view.world_size} processes x {d.replica_groups} replica groups = {b['global']} with every group present"
            if d.fault_tolerance == "replicas"
            else f"{b['world_size']} processes = {b['global']}"
        )
        run.log(
            f"world size {view.world_size} ({dist.launch.describe()}; backend {dist.backend or 'none'}, device "
            f"{view.device}); global batch = {b['per_process']} per process x {b['grad_accum_steps']} "
            f"accumulation x {across}; lr {view.lr:g}; "
            + (f"{b['steps_per_epoch']} steps per epoch" if b["steps_per_epoch"] else "epochs end with the stream")
            + f"; {view.data_workers} data workers per process"
            + (f"; {view.data_feed}" if view.data_feed else "")
            + "".join(f"; {change}" for change in process_state.in_effect())
        )  # torch's defaults, unless listed

    def on_log(self, view, values):
        step, every = view.step, view.config.logging.log_every
        if view.is_main:  # for `ddplab status`, through rank 0's heartbeat
            view.dist.beat.progress = {"elapsed_s": view.elapsed, "eta_s": eta_s(view), "at": time.time()}
        if not _bar_shown(view) and (step % (every * 10) == 0 or every == 1):
            view.run.log(f"epoch {view.epoch} step {step}: loss {values['loss']:.4f} lr {values['lr']:.3e}")

    def on_eval_end(self, view, split, metrics):
        if split == "test" and metrics:
            scores = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if isinstance(v, float) and k != "samples")
            view.run.log(f"test ({int(metrics.get('samples', 0))} samples, best model): {scores}")
        every = view.config.training.eval_every
        if split == "val" and every and view.step % every == 0 and view.eval_at == "train":
            view.run.log(
                f"step {view.step}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if isinstance(v, float))
            )

    def on_epoch_end(self, view, row):
        run, per_epoch = view.run, view.steps_per_epoch
        elapsed = view.elapsed  # the row's tick came after its evaluation: eval_time_s is in it already
        row["eta_s"] = eta = eta_s(view)
        row["predicted_end_s"] = elapsed + eta if eta is not None else None
        run.write_epochs(view.history)
        head = f"epoch {row['epoch']}"
        if row.get("partial") and per_epoch:  # a run stopped mid-epoch (max_steps, time budget): say how far it got
            head += f" (partial, {row['step'] - (row['epoch'] - 1) * per_epoch}/{per_epoch} steps)"
        run.log(
            f"{head}: "
            + ", ".join(f"{k} {row[k]:.4g}" for k in self.keys or self.ROW_KEYS if isinstance(row.get(k), (int, float)))
            + f"; elapsed {format_duration(elapsed)}"
            + (f", ETA {format_duration(eta)}" if eta is not None else "")
        )


def eta_s(view) -> float | None:
    """Seconds of training left at the run's measured pace (steps, evaluations and snapshots so far),
    to the first stop condition it meets: epochs, training.max_steps or training.time_budget."""
    t, elapsed = view.config.training, view.elapsed
    if view.step == 0 or elapsed <= 0:
        return None
    per_epoch = view.steps_per_epoch or float("inf")  # a stream: until training.max_steps
    total = min(per_epoch * view.epochs_planned, t.max_steps or float("inf"))
    left = max(total - view.step, 0) * elapsed / view.step
    if view.time_budget_s is not None:
        left = min(left, max(view.time_budget_s - elapsed, 0.0))
    return left


def _bar_shown(view) -> bool:
    return view.is_main and view.config.logging.progress and sys.stdout.isatty()


class ProgressBar(Callback):
    """A rich progress bar on rank 0, in terminals only (train.log gets the periodic lines instead)."""

    progress = None

    def on_epoch_start(self, view):
        if not _bar_shown(view):
            return
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=view.run.console,
            transient=True,
        )
        self.progress.add_task(f"epoch {view.epoch}", total=view.epoch_samples)
        self.progress.start()

    def on_step_end(self, view):
        if self.progress is not None:
            self.progress.update(self.progress.task_ids[0], advance=view.step_samples)

    def on_log(self, view, values):
        if self.progress is not None:
            eta = eta_s(view)
            self.progress.update(
                self.progress.task_ids[0],
                description=f"epoch {view.epoch} "
                f"loss {values['loss']:.4f} lr {values['lr']:.2e} elapsed {format_duration(view.elapsed)}"
                + (f" ETA {format_duration(eta)}" if eta is not None else ""),
            )

    def on_epoch_end(self, view, row):
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    on_train_end = on_epoch_end  # a run stopped mid-epoch ends the bar too


def column_callbacks() -> list[Callback]:
    """The columns ddplab adds to every epoch row; they run before user callbacks and the recorder."""
    return [EpochColumns(), Stragglers(), ProgressBar()]
