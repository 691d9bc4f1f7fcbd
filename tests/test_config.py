from pathlib import Path

import pytest

from ddplab.config import Config
from ddplab.config_io import parse_duration
from ddplab.errors import UserError
from ddplab.registry import load_config

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_are_the_embedded_char_gpt():
    cfg = load_config()
    assert cfg.model.name == "gpt" and cfg.data.name == "text" and cfg.data.path is None


def test_overrides_convert_types():
    cfg = load_config(
        None,
        [
            "training.lr=3e-4",
            "training.batch_size=16",
            "training.amp=bf16",
            "logging.trackers=[]",
            "training.max_steps=null",
            "experiment.name=x",
        ],
    )
    assert cfg.training.lr == pytest.approx(3e-4) and isinstance(cfg.training.lr, float)
    assert cfg.training.batch_size == 16 and cfg.training.amp == "bf16"
    assert cfg.logging.trackers == [] and cfg.training.max_steps is None and cfg.experiment.name == "x"


def test_none_is_a_choice_for_choice_fields_and_null_for_optional_ones():
    cfg = load_config(
        None,
        [
            "training.amp=none",
            "distributed.comm_hook=none",
            "training.lr_scaling=none",
            "training.max_steps=none",
            "training.clip_grad_norm=None",
        ],
    )
    assert (cfg.training.amp, cfg.distributed.comm_hook, cfg.training.lr_scaling) == ("none", "none", "none")
    assert cfg.training.max_steps is None and cfg.training.clip_grad_norm is None


@pytest.mark.parametrize(
    "override, words",
    [
        ("training.lr=abc", ["training.lr", "number"]),
        ("training.lr=null", ["training.lr", "null"]),
        ("training.batch_size=none", ["training.batch_size", "null"]),
        ("training.lr_scaling=null", ["training.lr_scaling", "sqrt"]),
        ("training.batch_size=-1", ["training.batch_size", "> 0"]),
        ("training.batch_size=2.5", ["training.batch_size", "integer"]),
        ("model.name=nope", ["model.name", "gpt"]),
        ("training.nope=1", ["training.nope", "batch_size"]),
        ("training.amp=fp8", ["training.amp", "bf16"]),
        ("training.time_budget=soon", ["training.time_budget", "90m"]),
        ("model.dim=30", ["model.dim", "model.heads"]),
        ("training", ["key=value"]),
    ],
)
def test_bad_values_name_the_field(override, words):
    with pytest.raises(UserError) as err:
        load_config(None, [override])
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_yaml_unknown_key_and_type(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("training:\n  epochs: two\n")
    with pytest.raises(UserError, match="training.epochs"):
        load_config(bad)
    bad.write_text("trainig:\n  epochs: 2\n")
    with pytest.raises(UserError, match="trainig"):
        load_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(UserError, match="mapping"):
        load_config(bad)


def test_durations():
    assert parse_duration("2h") == 7200 and parse_duration("90m") == 5400 and parse_duration("30s") == 30
    assert parse_duration("45") == 45


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("**/*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
