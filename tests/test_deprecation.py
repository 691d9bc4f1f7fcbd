"""A public name that was retired keeps working, with a DeprecationWarning naming its replacement."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ddplab.config.reading import read_config
from ddplab.engine.loop.view import TrainView
from ddplab.errors import UserError


def test_view_phase_reads_eval_at_and_names_it():
    view = TrainView(SimpleNamespace(eval_at="epoch_end"))
    said = r"TrainView\.phase is deprecated and goes in ddplab 0\.3: use TrainView\.eval_at"
    with pytest.warns(DeprecationWarning, match=said):
        assert view.phase == "epoch_end"


def test_view_phase_stays_read_only():
    view = TrainView(SimpleNamespace(eval_at="train"))
    with pytest.raises(AttributeError):
        view.phase = "test"


@pytest.mark.parametrize("given, trackers", [("true", ["tensorboard"]), ("false", [])])
def test_logging_tensorboard_reads_as_logging_trackers_and_names_it(given, trackers, tmp_path):
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(f"logging:\n  tensorboard: {given}\n")
    for source, overrides in ((None, [f"logging.tensorboard={given}"]), (yaml_file, [])):
        said = r"config key logging\.tensorboard is deprecated and goes in ddplab 0\.3: use logging\.trackers"
        with pytest.warns(DeprecationWarning, match=said):
            assert read_config(source, overrides).logging.trackers == trackers


def test_a_retired_key_keeps_its_old_type_check():
    with pytest.warns(DeprecationWarning), pytest.raises(UserError, match="logging.tensorboard"):
        read_config(None, ["logging.tensorboard=maybe"])
