"""The Trainer handed small fake parts, in this process: no process group, no run folder, no loader.

A one-layer model, a list of batches as the data feed, the plain modes (engine/parallel/fault_tolerance.py's NoReplicas,
engine/parallel/sharding.py's Replicated) or fakes of them; a world of one process (FakeCtx).
"""

import copy
from itertools import islice
from types import SimpleNamespace

import pytest
import torch

import ddplab
from ddplab.config import batch_arithmetic
from ddplab.engine.loop.parts import TrainParts
from ddplab.engine.loop.trainer import Trainer
from ddplab.engine.parallel.fault_tolerance import NoReplicas
from ddplab.engine.parallel.sharding import Replicated
from ddplab.registry import load_config

BATCH, LR = 4, 0.1


class FakeCtx:
    """One process, no process group: every reduction is the identity."""

    world_size, rank, is_main, is_distributed, backend = 1, 0, True, False, "none"
    device = torch.device("cpu")
    beat = SimpleNamespace(mark=lambda *args: None)

    def all_reduce(self, tensor, op="sum"):
        return tensor

    def barrier(self):
        pass

    def gather_objects(self, obj):
        return [obj]

    def broadcast_object(self, obj):
        return obj


class ListFeed:
    """The data feed's interface over a list of (inputs, target) batches: one rank's, map-style."""

    inexact, how = None, None

    def __init__(self, batches):
        self.batches, self.size = batches, sum(len(y) for _, y in batches)
        self.ended: list[tuple] = []

    def epoch(self, epoch, consumed):
        self.start = consumed
        return iter(self.batches[consumed // BATCH :])

    def left(self):
        return self.size - self.start

    def next_step(self, batches, accum):
        return list(islice(batches, accum))

    def end_epoch(self, n, steps, planned, notes, replan):
        self.ended.append((n, steps, planned))
        return {}

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def batches(n, seed=0, bad=()):
    """`n` regression batches of BATCH samples; those numbered in `bad` have a NaN target."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x, y = torch.randn(BATCH, 3, generator=g), torch.randn(BATCH, 1, generator=g)
        out.append((x, torch.full_like(y, float("nan")) if i in bad else y))
    return out


def trainer(tmp_path, data, *overrides, faults=None, strategy=None, callbacks=(), accum=1) -> Trainer:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    cfg = load_config(
        None,
        [
            "logging.log_every=1",
            f"training.grad_accum_steps={accum}",
            f"training.batch_size={BATCH}",
            "training.clip_grad_norm=null",
            "checkpoint.save_best=false",
            f"experiment.output_dir={tmp_path}",
            *overrides,
        ],
    )
    feed = ListFeed(data)
    parts = TrainParts(
        model,
        model,
        None,
        optimizer,
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
        torch.amp.GradScaler("cpu", enabled=False),
        SimpleNamespace(close=lambda: None, workers=0),
        feed,
        LR,
        1,
        batch_arithmetic(BATCH, accum, 1, feed.size),
        1,
        strategy or Replicated(),
        faults or NoReplicas(),
    )
    work = ddplab.Data(train=data, task=ddplab.Regression())
    lines: list[str] = []
    run = SimpleNamespace(path=tmp_path / "run", log=lines.append, lines=lines)
    return Trainer(cfg, FakeCtx(), work, parts, run, callbacks)  # type: ignore[arg-type]


def sgd_step(model, inputs, target):
    """What one SGD step on the mean squared error over (inputs, target) makes of a copy of `model`."""
    model = copy.deepcopy(model)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(inputs), target).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return model


def same(a, b) -> bool:
    return all(torch.allclose(p, q, atol=1e-6) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_one_step_updates_the_model_and_counts_its_samples(tmp_path):
    data = batches(2)
    t = trainer(tmp_path, data)
    expected = sgd_step(t.raw, *data[0])
    loss = torch.nn.functional.mse_loss(t.raw(data[0][0]), data[0][1]).item()
    t.train_step([data[0]])
    s = t.state
    assert (s.step, s.epoch_steps, s.consumed, t.last_step_samples) == (1, 1, BATCH, BATCH)
    assert same(t.raw, expected)
    t.log_interval()  # the ledger's loss, reduced: the logged loss is the step's mean
    assert s.steps[-1]["loss"] == pytest.approx(loss, rel=1e-6) and s.epoch_samples == BATCH


def test_accumulated_micro_batches_make_the_step_of_their_concatenation(tmp_path):
    data = batches(2)
    t = trainer(tmp_path, data, accum=2)
    whole = (torch.cat([data[0][0], data[1][0]]), torch.cat([data[0][1], data[1][1]]))
    expected = sgd_step(t.raw, *whole)
    t.train_step(data)
    assert (t.state.step, t.state.consumed) == (1, 2 * BATCH)
    assert same(t.raw, expected)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")  # a skipped step still steps the schedule
def test_a_non_finite_step_is_skipped_and_said_under_nonfinite_skip(tmp_path):
    data = batches(2, bad={0})
    t = trainer(tmp_path, data, "training.nonfinite=skip")
    before = copy.deepcopy(t.raw)
    t.train_step([data[0]])
    assert same(t.raw, before)  # no update: the weights are not NaN
    assert t.run.lines == ["step 1: non-finite loss on some rank; step skipped (training.nonfinite=skip)"]
    expected = sgd_step(t.raw, *data[1])
    t.train_step([data[1]])
    assert same(t.raw, expected) and t.state.step == 2
    t.log_interval()
    assert t.state.epoch_samples == BATCH  # the skipped step's loss and samples are left out


def test_a_callbacks_stop_request_ends_fit_at_that_step_with_a_snapshot(tmp_path):
    class StopAtTwo(ddplab.Callback):
        def on_step_end(self, view):
            if view.step == 2:
                view.request_stop("enough")

    t = trainer(tmp_path, batches(5), callbacks=[StopAtTwo()])
    state = t.fit()
    assert (state.stop_reason, state.step, state.epoch, state.consumed) == ("enough", 2, 0, 2 * BATCH)
    assert (tmp_path / "run" / "checkpoints" / "step-000000002" / "COMPLETE").is_file()
    assert [row["step"] for row in state.history] == [2] and state.history[0]["partial"]


def test_a_whole_epoch_tells_the_feed_its_steps(tmp_path):
    t = trainer(tmp_path, batches(3))
    state = t.fit()
    assert (state.stop_reason, state.step, state.epoch) == ("epochs", 3, 1)
    assert t.feed.ended == [(1, 3, 3)]


class Refusing(NoReplicas):
    """A fault-tolerance mode whose peers never commit a step (a group fails during each)."""

    def __init__(self):
        self.calls: list[str] = []

    def begin_step(self):
        self.calls.append("begin")
        return False

    def agree(self, params, optimizer, stop, step, samples):
        self.calls.append(f"agree {step} {samples}")
        return False

    def restore_lr(self, optimizer):
        self.calls.append("restore_lr")


def test_a_step_the_fault_tolerance_does_not_commit_is_not_counted(tmp_path):
    data = batches(3)
    t = trainer(tmp_path, data, faults=Refusing())
    before = copy.deepcopy(t.raw)
    assert t.train_epoch()
    s = t.state
    assert (s.step, s.epoch_steps, s.consumed) == (0, 0, 0)  # the epoch's data was read; its position starts over
    assert t.faults.calls == ["begin", "agree 1 4"] * 3
    assert same(t.raw, before) and all(p.grad is None for p in t.raw.parameters())
    t.log_interval()
    assert s.epoch_samples == 0  # no loss of an uncommitted step is logged


def test_the_sharding_strategy_reduces_gradients_on_the_last_micro_step_only(tmp_path):
    class Recording(Replicated):
        def __init__(self):
            self.last: list[bool] = []

        def micro_step(self, model, last):
            self.last.append(last)
            return super().micro_step(model, last)

    strategy = Recording()
    t = trainer(tmp_path, batches(3), strategy=strategy, accum=3)
    t.train_step(t.feed.batches)
    assert strategy.last == [False, False, True]
