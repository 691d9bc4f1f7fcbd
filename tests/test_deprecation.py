"""A public name that was retired keeps working, with a DeprecationWarning naming its replacement."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ddplab.engine.callbacks import TrainView


def test_view_phase_reads_eval_at_and_names_it():
    view = TrainView(SimpleNamespace(eval_at="epoch_end"))
    with pytest.warns(DeprecationWarning, match=r"TrainView\.phase is deprecated .*use TrainView\.eval_at"):
        assert view.phase == "epoch_end"


def test_view_phase_stays_read_only():
    view = TrainView(SimpleNamespace(eval_at="train"))
    with pytest.raises(AttributeError):
        view.phase = "test"
