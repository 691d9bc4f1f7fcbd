"""The rule that gives each test its tier (tests/tiers.py), on small functions shaped like tests."""

import subprocess
import sys

import pytest

import tiers
from conftest import ddplab, main


def _starts_python():
    return subprocess.run([sys.executable, "-c", "pass"])


def _through_a_helper():
    return _starts_python()


def _cli_in_process():
    return main("train", "--help")


def _local_import_of_the_api():
    import ddplab as api

    return api.train


def _pure():
    return sorted([3, 1, 2])


def _the_cli_in_a_process():
    return ddplab("train", "--help")


def _binds_its_own_ddplab(ddplab):
    return ddplab.train  # an argument named like the helper: not the helper


@pytest.mark.unit  # the rule would follow the functions named here, which only are looked at
@pytest.mark.parametrize(
    "fn, tier",
    [
        (_starts_python, "multiproc"),
        (_through_a_helper, "multiproc"),
        (_the_cli_in_a_process, "multiproc"),
        (_cli_in_process, "inproc"),
        (_local_import_of_the_api, "inproc"),
        (_pure, "unit"),
        (_binds_its_own_ddplab, "unit"),
    ],
)
def test_a_function_gets_the_tier_its_code_shows(fn, tier):
    assert tiers._kind(fn) == tier


def test_only_python_processes_count():
    assert tiers._python([sys.executable, "-m", "ddplab"]) and tiers._python(["torchrun", "--standalone"])
    assert tiers._python("python3 -c pass") and not tiers._python(["git", "rev-parse", "HEAD"])


def test_the_rule_marks_a_test_of_pure_code_unit(request):
    assert request.node.get_closest_marker("unit") is not None  # this very test, by the rule


@pytest.mark.multiproc
def test_an_explicit_tier_is_kept(request):
    assert [t for t in tiers.TIERS if request.node.get_closest_marker(t)] == ["multiproc"]
