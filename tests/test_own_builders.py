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
