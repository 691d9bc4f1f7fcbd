from pathlib import Path

import pytest

from ddplab.config import Config
from ddplab.config.reading import parse_duration
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


# ---------------------------------------------------------------------------- replica groups' numbers

REPLICAS = "distributed.fault_tolerance=replicas"
ENV_NAMES = (
    "REPLICA_GROUP_ID",
    "NUM_REPLICA_GROUPS",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_ARRAY_TASK_MIN",
    "SLURM_ARRAY_TASK_COUNT",
)


@pytest.fixture
def launcher_env(monkeypatch):
    """Sets the variables a cluster's launcher would; none come from the machine running the tests. The groups'
    Lighthouse is one such (a job in replica groups needs its address)."""
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://lighthouse:29510")

    def put(**values):
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    return put


def _place(*overrides: str) -> tuple[int, int]:
    d = load_config(None, list(overrides)).distributed
    return d.replica_group, d.replica_groups


def test_replica_groups_default_from_torchft_then_a_slurm_array_then_0_of_1(launcher_env):
    assert _place(REPLICAS) == (0, 1)
    launcher_env(SLURM_ARRAY_TASK_ID="5", SLURM_ARRAY_TASK_MIN="4", SLURM_ARRAY_TASK_COUNT="2")
    assert _place(REPLICAS) == (1, 2)  # task 5 of the array 4-5
    launcher_env(REPLICA_GROUP_ID="2", NUM_REPLICA_GROUPS="3")  # torchft's own variables before SLURM's
    assert _place(REPLICAS) == (2, 3)
    assert load_config(None, [REPLICAS, "experiment.name=x"]).run_name() == "x-group2"


def test_replica_groups_given_in_the_config_win_over_the_environment(launcher_env):
    launcher_env(REPLICA_GROUP_ID="2", NUM_REPLICA_GROUPS="3", SLURM_ARRAY_TASK_ID="1", SLURM_ARRAY_TASK_COUNT="2")
    assert _place(REPLICAS, "distributed.replica_group=0") == (0, 3)
    assert _place(REPLICAS, "distributed.replica_groups=4") == (2, 4)
    assert _place(REPLICAS, "distributed.replica_group=1", "distributed.replica_groups=2") == (1, 2)


def test_a_job_without_replica_groups_ignores_the_variables(launcher_env):
    """Any job of a SLURM array (a sweep) sets them: only fault_tolerance=replicas reads them."""
    launcher_env(REPLICA_GROUP_ID="x", SLURM_ARRAY_TASK_ID="7", SLURM_ARRAY_TASK_COUNT="3")
    assert _place() == (0, 1) and load_config(None, ["experiment.name=x"]).run_name() == "x"


@pytest.mark.parametrize(
    "env, line",
    [
        ({"REPLICA_GROUP_ID": "one"}, "REPLICA_GROUP_ID='one' in the environment is not a whole number"),
        ({"NUM_REPLICA_GROUPS": "-2"}, "NUM_REPLICA_GROUPS='-2' in the environment is not a whole number"),
        ({"NUM_REPLICA_GROUPS": "0"}, "NUM_REPLICA_GROUPS=0: a job has 1 to 4194304 replica groups"),
        (
            {"REPLICA_GROUP_ID": "2", "NUM_REPLICA_GROUPS": "2"},
            "REPLICA_GROUP_ID=2 is not below NUM_REPLICA_GROUPS=2",
        ),
        ({"REPLICA_GROUP_ID": "1"}, "REPLICA_GROUP_ID=1 is not below distributed.replica_groups=1 (its default)"),
        (  # a stepped array, --array=0-6:2
            {"SLURM_ARRAY_TASK_ID": "6", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_COUNT": "4"},
            "SLURM_ARRAY_TASK_ID=6 is not below SLURM_ARRAY_TASK_COUNT=4; a SLURM job array of N groups is "
            "--array=0-<N-1>",
        ),
        (
            {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "4", "SLURM_ARRAY_TASK_COUNT": "2"},
            "SLURM_ARRAY_TASK_ID=3 is below SLURM_ARRAY_TASK_MIN=4",
        ),
        ({"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2.0"}, "SLURM_ARRAY_TASK_COUNT='2.0' in the"),
    ],
)
def test_bad_replica_group_variables_are_one_line_naming_the_variable(launcher_env, capfd, env, line):
    from conftest import main

    launcher_env(**env)
    assert main("train", REPLICAS, "training.max_steps=1") == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddplab: error: " + line), err


def test_the_launchers_own_groups_win_over_the_environment(launcher_env, monkeypatch):
    """`--replica-groups N` numbers its groups itself: variables left by another launcher are not read."""
    import ddplab.commands.train as train_command
    from conftest import main

    started = {}
    monkeypatch.setattr(train_command, "note_launch", lambda: None)
    monkeypatch.setattr(train_command, "run_workers", lambda nproc, args, **kw: started.update(kw) or 0)
    launcher_env(REPLICA_GROUP_ID="5", NUM_REPLICA_GROUPS="2")
    assert main("train", "--replica-groups", "3", REPLICAS, "training.max_steps=1") == 0
    assert started["groups"] == 3


def test_a_resumed_group_is_its_own_run_and_another_group_is_not(launcher_env, tmp_path):
    """config.yaml records the numbers resolved from the environment; the same job started again
    (same variables) continues its run, a job told another group's number is refused."""
    import yaml

    from ddplab.engine.snapshots.fingerprint import check_resume

    launcher_env(SLURM_ARRAY_TASK_ID="1", SLURM_ARRAY_TASK_COUNT="2")
    cfg = load_config(None, [REPLICAS])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))  # as the run folder holds it
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["distributed"]["replica_group"] == 1
    check_resume(tmp_path, load_config(None, [REPLICAS]).to_dict())
    with pytest.raises(UserError, match=r"distributed\.replica_group: 1 -> 0"):
        check_resume(tmp_path, load_config(None, [REPLICAS, "distributed.replica_group=0"]).to_dict())


def test_a_run_recorded_before_the_numbers_were_unset_resumes(launcher_env, tmp_path):
    """A config.yaml written when the fields defaulted to 0 and 1 (replica_group: 0, replica_groups: 1)."""
    import yaml

    from ddplab.engine.snapshots.fingerprint import check_resume

    old = Config().to_dict()
    old["distributed"].update(replica_group=0, replica_groups=1)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    launcher_env(SLURM_ARRAY_TASK_ID="3", SLURM_ARRAY_TASK_COUNT="8")  # one job of a sweep's array
    check_resume(tmp_path, load_config().to_dict())


def test_a_loaded_config_is_frozen_and_refuses_a_change_naming_the_key():
    """What load_config returns is what the run reads to its end: a field, an option or a list item set
    afterwards is refused with the dotted key; the Config the caller handed in stays theirs to change."""
    import copy
    import pickle
    import re
    from dataclasses import FrozenInstanceError

    import yaml

    mine = Config()
    mine.model.options = {"depth": 2, "sizes": [1, 2]}
    cfg = load_config(mine, ["model.options.width=3", "logging.trackers=[tensorboard]"])
    changes = {
        "training.lr": lambda c: setattr(c.training, "lr", 1.0),
        "training": lambda c: setattr(c, "training", None),
        "model.options": lambda c: c.model.options.update(depth=3),
        "model.options.sizes": lambda c: c.model.options["sizes"].append(3),
        "logging.trackers": lambda c: c.logging.trackers.clear(),
    }
    for copied in (cfg, copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):  # a rank's copy is frozen too
        for key, change in changes.items():
            with pytest.raises(FrozenInstanceError, match=rf"'{re.escape(key)}' cannot change"):
                change(copied)
    assert cfg.model.options == {"depth": 2, "sizes": [1, 2], "width": 3} and cfg.logging.trackers == ["tensorboard"]
    assert yaml.safe_load(yaml.safe_dump(cfg.to_dict())) == cfg.to_dict()  # plain values for config.yaml
    mine.training.lr = 1.0  # the caller's own: loading read a copy of it
    assert cfg.training.lr == Config().training.lr and load_config(mine).training.lr == 1.0
