"""The one-door contracts: callbacks read a view they cannot change; built-in names and code
references go through one resolver; one config loader takes every form of config; test-only
fault injection is not part of the product."""

from pathlib import Path

import pytest

import ddplab
from ddplab import registry
from ddplab.config import batch_arithmetic
from ddplab.engine.loop.view import Callback
from ddplab.workload import resolve

SRC = Path(__file__).resolve().parents[1] / "src" / "ddplab"
TINY = [
    "model.layers=1",
    "model.dim=32",
    "model.heads=2",
    "model.context=32",
    "training.batch_size=8",
    "training.max_steps=3",
    "logging.trackers=[]",
    "logging.progress=false",
    "generate.max_new_tokens=0",
]


class Tamper(Callback):
    """Tries to change the run through what it is handed, and notes what happened."""

    def __init__(self):
        self.refused, self.history_copy = [], None

    def on_log(self, view, values):
        for name, value in (("step", 0), ("epoch", 5), ("model", None), ("optimizer", None)):
            try:
                setattr(view, name, value)
            except AttributeError:
                self.refused.append(name)
        self.history_copy = isinstance(view.log_rows, tuple)  # a copy: the run's own list stays out of reach


def test_a_callback_cannot_assign_to_the_run_it_sees(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tamper = Tamper()
    summary = ddplab.train(None, [*TINY, "logging.log_every=1"], callbacks=[tamper])
    assert summary["status"] == "complete" and summary["steps"][-1]["step"] == 3
    assert sorted(set(tamper.refused)) == ["epoch", "model", "optimizer", "step"] and tamper.history_copy


def test_a_built_in_name_resolves_through_the_same_resolver_as_a_reference():
    for name, field in (("gpt", "model.name"), ("text", "data.name"), ("cnn", "model.name")):
        entry = (registry.model_entry if field == "model.name" else registry.data_entry)(name)
        reference = entry.ref
        assert reference.startswith("ddplab.workloads.") and ":" in reference
        assert (
            registry.workload(
                registry.load_config(None, [f"{field}={name}", *(["data.name=digits"] if name == "cnn" else [])])
            ).references[field.split(".")[0]]
            == reference
        )
        assert callable(resolve(reference, field))


def test_one_loader_takes_a_path_a_dict_and_a_config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  lr: 0.001\n")
    from_path = registry.load_config(path, ["training.epochs=3"])
    from_dict = registry.load_config({"training": {"lr": 0.001}}, ["training.epochs=3"])
    assert from_path.to_dict() == from_dict.to_dict() == registry.load_config(from_dict).to_dict()
    with pytest.raises(ddplab.UserError, match="data.name: unknown dataset"):
        registry.load_config({"data": {"name": "nope"}})


def test_the_batch_is_counted_once():
    assert batch_arithmetic(8, 2, 4, 1000) == {
        "per_process": 8,
        "grad_accum_steps": 2,
        "world_size": 4,
        "global": 64,
        "steps_per_epoch": 16,
    }


def test_fault_injection_and_test_hooks_are_not_in_the_product():
    assert not any(p.name == "faults.py" for p in SRC.rglob("*.py"))
    assert not any("DDPLAB_FAULT" in p.read_text() for p in SRC.rglob("*.py"))
    assert not [h for h in vars(Callback) if h == "on_snapshot_saving"]
