"""What callbacks see of the loop: the trainer calls their hooks at fixed points, on every rank, in list order;
ddplab's own progress, files and columns go through the same hooks as a user's. A hook gets a read-only `TrainView`,
never the trainer: it observes, and steers only through `view.request_stop` (changing the model or the optimizer
breaks exact resume). A hook that calls a collective must do so on all ranks; one that writes files checks is_main.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ddplab.callbacks import Callback
from ddplab.config.deprecation import renamed
from ddplab.errors import RunError, UserError, printable

HOOKS = [name for name in vars(Callback) if name.startswith("on_")]


class TrainView:
    """What a callback may read of a run in progress; nothing here can be assigned. Each property reads the
    trainer's own attribute; a list or a dict is handed out as a copy (tuple, dict), so that a callback cannot
    change the run through it."""

    def __init__(self, trainer) -> None:
        self._t = trainer

    # progress
    step = property(lambda v: v._t.state.step, doc="Optimizer steps taken.")
    epochs_completed = property(lambda v: v._t.state.epoch, doc="Whole epochs trained so far.")
    elapsed = property(lambda v: v._t.state.elapsed, doc="Seconds of training so far, across restarts.")
    resumes = property(lambda v: v._t.state.resumes, doc="How many times this run continued from a snapshot.")
    snapshot_stalls = property(
        lambda v: tuple(v._t.state.snapshot_stalls), doc="Each snapshot's {step, stall_s, async}."
    )
    stop_reason = property(
        lambda v: v._t.state.stop_reason, doc="None while training; then why it stopped (metrics.json)."
    )
    # what is trained, where
    model = property(lambda v: v._t.raw, doc="The module being trained, without its DDP / torch.compile wrappers.")
    optimizer = property(lambda v: v._t.optimizer, doc="The optimizer (its param_groups hold the current lr).")
    run = property(
        lambda v: v._t.run, doc="The run folder: .path, .log(message) (rank 0 prints, appends to train.log)."
    )
    config = property(
        lambda v: v._t.cfg, doc="The resolved Config, frozen: assigning to it raises dataclasses.FrozenInstanceError."
    )
    data = property(lambda v: v._t.data, doc="The workload's ddplab.Data (splits, task, meta).")
    dist = property(lambda v: v._t.ctx, doc="The DistContext: reductions and barriers, for hooks that every rank runs.")
    rank = property(lambda v: v._t.ctx.rank, doc="This process's rank.")
    world_size = property(lambda v: v._t.ctx.world_size, doc="Processes in the job.")
    is_main = property(lambda v: v._t.ctx.is_main, doc="Rank 0: the one that writes files.")
    device = property(lambda v: v._t.ctx.device, doc="This process's torch.device.")
    # what ddplab's own columns and files are made from
    lr = property(lambda v: v._t.lr, doc="The peak learning rate, after training.lr_scaling.")
    time_budget_s = property(lambda v: v._t.stops.budget, doc="training.time_budget in seconds, or None.")
    comm = property(lambda v: v._t.comm, doc="The gradient all-reduce monitor (None in a one-process run).")
    evaluator = property(lambda v: v._t.evaluator, doc="The last evaluation's (classification: a confusion matrix).")
    data_workers = property(lambda v: v._t.loaders.workers, doc="DataLoader worker processes per rank.")
    activity = property(lambda v: v._t.clock.activity, doc="What the loop is doing now: train, eval or snapshot.")
    data_wait = property(lambda v: v._t.state.epoch_data_wait, doc="This rank's seconds waiting for data this epoch.")
    snapshot_time = property(lambda v: v._t.state.epoch_snapshot_time, doc="Snapshot seconds since the last row.")
    eval_at = property(lambda v: v._t.eval_at, doc="Where this evaluation was asked for: train, epoch_end or test.")
    phase = renamed("eval_at", "phase", until="0.3")
    history = property(lambda v: tuple(v._t.state.history), doc="One row per epoch so far (metrics.csv).")
    log_rows = property(lambda v: tuple(v._t.state.steps), doc="One row per log interval: step, epoch, loss, lr...")
    batch = property(
        lambda v: dict(v._t.batch), doc="ddplab.config.batch_arithmetic of this run: per_process, global..."
    )
    loss_average = property(
        lambda v: v._t.loss_average,
        doc="What the training loss is averaged over: items (the task's, on every rank) or samples (per process).",
    )
    steps_per_epoch = property(lambda v: v._t.batch["steps_per_epoch"], doc="Optimizer steps in a whole epoch.")
    epochs_planned = property(lambda v: v._t.epochs, doc="Epochs to train (inf: a stream, until training.max_steps).")
    data_feed = property(lambda v: v._t.feed.how, doc="How the training stream is split (None: map-style data).")
    data_notes = property(
        lambda v: tuple(v._t.state.data_notes), doc="What the data did that was not as planned (metrics.json)."
    )

    @property
    def epoch(self) -> int:
        """The epoch the run is in, or last finished, counted from 1 as metrics.csv counts them: from
        on_epoch_start to its on_epoch_end (and the snapshot after it) the same number, the `epoch` of
        that epoch's row. Before the first epoch of an attempt: the whole epochs already trained."""
        return self._t.state.epoch + 1 if self._t.in_epoch else self._t.state.epoch

    @property
    def best(self) -> tuple[float, int | None]:
        """(lowest validation loss at an epoch's end, that epoch); (inf, None) before any. It holds an
        epoch's evaluation from that evaluation's on_eval_end on."""
        return self._t.state.best_val_loss, self._t.state.best_epoch

    def request_stop(self, reason: str) -> None:
        """End the run, complete, with `reason` as its stop_reason (in metrics.json and the last line).
        Any hook on any rank may ask; all ranks agree where they meet anyway (the next log interval, or
        the snapshot after an epoch's end), then snapshot, evaluate and end. The stop is kept in the
        snapshot: running the same command again does not train on."""
        if not isinstance(reason, str) or not reason.strip():
            raise TypeError(f"request_stop: give the reason as a word or two (a string), got {reason!r}")
        self._t.stops.request = printable(reason.strip())  # one printable line, in the console and train.log

    @property
    def epoch_samples(self) -> int | None:
        """Samples (all ranks) still to come in this epoch, as counted at its start (None: a stream)."""
        left = self._t.feed.left()
        return None if math.isinf(left) else left * self._t.ctx.world_size

    @property
    def step_samples(self) -> int:
        """Samples (all ranks) of the last step."""
        return self._t.last_step_samples * self._t.ctx.world_size


class CallbackList:
    """Calls a hook on each callback in order: `callbacks.on_step_end(view)`."""

    def __init__(self, callbacks, interrupted: Callable[[str], None] | None = None) -> None:
        self.callbacks = list(callbacks)
        self.interrupted = interrupted  # told of a callback's KeyboardInterrupt, as of a Ctrl-C
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise UserError(f"callbacks: {cb!r} is not a ddplab.Callback (subclass ddplab.Callback)")

    def __getattr__(self, hook: str):
        if hook not in HOOKS:
            raise AttributeError(hook)

        def call(*args, **kwargs) -> None:
            for cb in self.callbacks:
                try:
                    getattr(cb, hook)(*args, **kwargs)
                except SystemExit as exc:  # not a way out: the run would end unrecorded, "running" for ever
                    raise RunError(
                        f"callback {type(cb).__name__}.{hook} raised SystemExit({exc.code!r}); "
                        f"a callback ends a run with view.request_stop(reason)"
                    ) from exc
                except KeyboardInterrupt:
                    if self.interrupted is None:
                        raise
                    self.interrupted(f"KeyboardInterrupt in callback {type(cb).__name__}.{hook}")

        return call

    def state_dict(self) -> dict:
        """The state of each callback that has a state_dict(), a snapshot's part: keyed by its class name
        and its index among callbacks of that class (`EarlyStopping.0`), so adding or removing a callback
        of another class leaves the keys as they were."""
        return {key: cb.state_dict() for key, cb in self._keyed() if callable(getattr(cb, "state_dict", None))}

    def load_state_dict(self, state: dict) -> None:
        """Each callback's own state back; one without a state in the snapshot (added since) stays as built."""
        for key, cb in self._keyed():
            if key in state and callable(getattr(cb, "load_state_dict", None)):
                cb.load_state_dict(state[key])

    def _keyed(self):
        seen: dict[str, int] = {}
        for cb in self.callbacks:
            name = type(cb).__name__
            seen[name] = seen.get(name, -1) + 1
            yield f"{name}.{seen[name]}", cb
