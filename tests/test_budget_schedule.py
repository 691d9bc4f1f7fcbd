"""A time budget plans warm-up + cosine over the budget, so the learning rate reaches its floor
when the budget ends; the plan is part of the scheduler's state; partial epochs are shown."""

import json
from types import SimpleNamespace

import pytest
import torch

from conftest import TINY_GPT, main
from ddplab.engine.loop.optim import Schedule, budget_total_steps, plan_for_budget


def _schedule(total=1000, warmup=5, kind="cosine"):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    t = SimpleNamespace(warmup_steps=warmup, schedule=kind, min_lr_ratio=0.1)
    return opt, Schedule(opt, t, total)


class OneRank:
    device = torch.device("cpu")

    def all_reduce(self, t, op="sum"):
        return t


def test_replan_moves_the_floor_and_is_kept_in_the_state():
    opt, sched = _schedule()
    for _ in range(20):
        opt.step()
        sched.step()
    sched.replan(60)
    assert opt.param_groups[0]["lr"] == sched.get_last_lr()[0] < 1.0  # the current lr follows at once
    for _ in range(40):
        opt.step()
        sched.step()
    assert sched.get_last_lr()[0] == pytest.approx(0.1)  # the floor at step 60, not 1000
    sched.replan(5000)
    assert sched.total == 1000  # a budget never plans past the configured epochs
    sched.replan(3)
    assert sched.total == 61  # nor before the step already taken

    _, again = _schedule()
    again.load_state_dict(sched.state_dict())
    assert (again.total, again.last_epoch) == (61, 60)
    _, unplanned = _schedule(total=1000)
    _, other = _schedule(total=500)  # resumed on another world size: its own configured plan
    other.load_state_dict(unplanned.state_dict())
    assert other.total == 500


def test_budget_estimate_from_the_pace_so_far():
    assert budget_total_steps(100, 10.0, 60.0) == 600
    assert budget_total_steps(100, 61.0, 60.0) == 100  # over budget: end now
    opt, sched = _schedule()
    for _ in range(10):
        opt.step()
        sched.step()
    plan_for_budget(sched, OneRank(), 10, 2.0, 20.0)
    assert sched.total == 100
    plan_for_budget(sched, OneRank(), 10, 2.0, None)  # no budget: nothing changes
    assert sched.total == 100


def test_budget_stopped_cosine_run_ends_at_its_floor_and_prints_the_part_epoch(tmp_path, corpus, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    code = main(
        "train",
        f"data.path={corpus}",
        *TINY_GPT,
        "generate.max_new_tokens=0",
        "training.epochs=1000",
        "training.time_budget=3s",
        "training.warmup_steps=2",
        "training.lr=1e-3",
        "training.min_lr_ratio=0.1",
        "logging.log_every=2",
        "checkpoint.save_best=false",
        "experiment.name=b",
    )
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    summary = json.loads((tmp_path / "experiments" / "b" / "metrics.json").read_text())
    assert summary["stop_reason"] == "time_budget"
    last = summary["epochs"][-1]
    floor = 1e-3 * 0.1
    assert abs(last["lr"] - floor) <= 0.05 * floor, (last["lr"], summary["steps"][-5:])
    assert max(s["lr"] for s in summary["steps"]) > 5 * floor  # it did pass through the peak
    if last.get("partial"):  # the budget ended inside an epoch: its row is printed and counted
        assert f"epoch {last['epoch']} (partial, " in out
        assert f"done: time_budget; {last['epoch'] - 1} epochs + 1 partial" in out
