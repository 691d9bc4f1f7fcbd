"""A user's own builder through the documented `Builders` table (examples/own_optimizer.py): the run trains
with the user's optimizer, not the one training.optimizer names."""

import shutil
import sys

import torch

import ddplab
from conftest import ROOT

FAST = ["logging.trackers=[]", "logging.progress=false", "training.epochs=2"]


class Optimizer(ddplab.Callback):
    """The optimizer the run trains with, as its hooks see it."""

    def on_train_end(self, view, summary):
        self.used = view.optimizer
        self.steps = view.step


def test_the_users_optimizer_builder_is_the_one_the_run_trains_with(tmp_path, monkeypatch):
    for name in ("own_optimizer.py", "regression_tabular.py"):
        shutil.copy(ROOT / "examples" / name, tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import own_optimizer

    try:
        check(own_optimizer)
    finally:  # another test's copy of these files is imported afresh
        sys.modules.pop("own_optimizer"), sys.modules.pop("regression_tabular")


def check(own_optimizer) -> None:
    seen = Optimizer()
    summary = own_optimizer.train(*FAST, callbacks=[seen])
    assert summary["status"] == "complete" and seen.steps > 0
    used = seen.used
    assert type(used) is torch.optim.SGD and used.defaults["nesterov"]
    assert [g["weight_decay"] for g in used.param_groups] == [1e-4, 0.0]
    assert all("momentum_buffer" in used.state[p] for g in used.param_groups for p in g["params"])  # it stepped
    # Without the builder, the same run trains with the optimizer the config names (AdamW by default).
    default = Optimizer()
    ddplab.train(
        overrides=["experiment.name=default", *FAST],
        model=own_optimizer.model,
        data=own_optimizer.data,
        callbacks=[default],
    )
    assert type(default.used) is torch.optim.AdamW


def test_each_builder_is_handed_the_section_of_the_config_it_reads(tmp_path, monkeypatch):
    """The optimizer and the schedule get the training section and the job (as a workload function gets it), the
    loaders and the feed the data section: none of them the whole config."""
    from ddplab.config import DataConfig, TrainingConfig
    from ddplab.engine.loop.loaders import Loaders, train_feed
    from ddplab.engine.loop.optim import build_optimizer, build_schedule
    from ddplab.engine.loop.parts import Builders

    for name in ("own_optimizer.py", "regression_tabular.py"):
        shutil.copy(ROOT / "examples" / name, tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import regression_tabular

    seen: dict = {}

    def keep(name, builder, section):
        def build(*args):
            seen[name] = args[section]
            if name in ("optimizer", "schedule"):
                seen[name + " job"] = args[1]
            return builder(*args)

        return build

    builders = Builders(
        optimizer=keep("optimizer", build_optimizer, 0),
        schedule=keep("schedule", build_schedule, 0),
        loaders=keep("loaders", Loaders, 0),
        feed=keep("feed", train_feed, 2),
    )
    try:
        summary = ddplab.train(
            overrides=["experiment.name=sections", *FAST],
            model=regression_tabular.model,
            data=regression_tabular.data,
            builders=builders,
        )
    finally:
        sys.modules.pop("regression_tabular")
    assert summary["status"] == "complete"
    assert isinstance(seen["optimizer"], TrainingConfig) and isinstance(seen["schedule"], TrainingConfig)
    assert isinstance(seen["loaders"], DataConfig) and isinstance(seen["feed"], DataConfig)
    job = seen["optimizer job"]
    assert (job.rank, job.world_size, job.config.training) == (0, 1, seen["optimizer"]) and job.dist is not None
