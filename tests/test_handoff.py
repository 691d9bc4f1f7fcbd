"""The launcher-to-worker channel: one typed module, the only place a DDPLAB_ variable is named."""

from pathlib import Path

from ddplab.runtime.handoff import Handoff

SRC = Path(__file__).resolve().parents[1] / "src" / "ddplab"


def test_what_the_launcher_writes_a_worker_reads_back():
    told = Handoff(
        report_dir="/tmp/r",
        locked_run="/runs/a",
        lock_token="f00d",
        launched_at=1764000000.125,
    )
    env = told.env()
    assert env == {
        "DDPLAB_REPORT_DIR": "/tmp/r",
        "DDPLAB_LOCKED_RUN": "/runs/a",
        "DDPLAB_LOCK_TOKEN": "f00d",
        "DDPLAB_LAUNCHED_AT": "1764000000.125",
    }
    assert Handoff.read(env) == told


def test_unset_and_unreadable_values_read_as_none():
    assert Handoff().env() == {} and Handoff.read({}) == Handoff()
    assert Handoff.read({"DDPLAB_LAUNCHED_AT": "yesterday", "DDPLAB_LOCKED_RUN": ""}) == Handoff()


def test_no_other_module_names_a_ddplab_variable():
    named = [
        p.relative_to(SRC).as_posix()
        for p in SRC.rglob("*.py")
        if "DDPLAB_" in p.read_text() and p.name != "handoff.py"
    ]
    assert named == []
