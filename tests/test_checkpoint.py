"""Snapshots: atomic, complete-or-ignored, loaded safely, with fallback to older ones."""

import os

import pytest
import torch

from ddplab.engine.parallel.distributed import DistContext, LaunchInfo
from ddplab.engine.snapshots.manifest import MARKER
from ddplab.engine.snapshots.read import STATE, load_file, load_snapshot, step_snapshots
from ddplab.engine.snapshots.write import Checkpointer, Parts, part
from ddplab.errors import UserError

ONE = DistContext(LaunchInfo("none"), None, torch.device("cpu"))


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((3,), value)}, "trainer": {"step": int(value)}}


def _save(ck: Checkpointer, step: int):
    parts = Parts()
    for name, state in _state(step).items():
        parts.add(name, part(lambda state=state: state))
    return ck.save(parts, ONE, f"step-{step:09d}", {"step": step, "world_size": 1})


def test_snapshots_are_complete_folders_and_keep_last(tmp_path):
    ck = Checkpointer(tmp_path, is_main=True, keep_last=2)
    for step in (1, 2, 3):
        path = _save(ck, step)
        assert (path / MARKER).is_file() and (path / STATE).is_file()
    assert [p.name for p in step_snapshots(tmp_path)] == ["step-000000002", "step-000000003"]
    assert not list(tmp_path.glob(".tmp-*"))


def test_incomplete_snapshots_are_ignored_then_cleaned(tmp_path):
    ck = Checkpointer(tmp_path, is_main=True)
    _save(ck, 1)
    (tmp_path / ".tmp-step-000000002").mkdir()
    torch.save(_state(2), tmp_path / ".tmp-step-000000002" / STATE)
    (tmp_path / "step-000000003").mkdir()  # data without its marker
    torch.save(_state(3), tmp_path / "step-000000003" / STATE)
    assert ck.latest().name == "step-000000001"
    with pytest.raises(UserError, match="incomplete"):
        load_snapshot(tmp_path / "step-000000003")
    ck.clean_incomplete()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000001"]


def test_a_truncated_newest_snapshot_falls_back_to_the_previous_one(tmp_path):
    ck = Checkpointer(tmp_path, is_main=True)
    _save(ck, 1)
    newest = _save(ck, 2)
    data = (newest / STATE).read_bytes()
    (newest / STATE).write_bytes(data[: len(data) // 2])
    messages = []
    where, _, snap = ck.newest(messages.append)
    assert where.name == "step-000000001" and torch.equal(snap["model"]["w"], torch.full((3,), 1.0))
    assert len(messages) == 1 and "step-000000002" in messages[0] and "truncated" in messages[0]


def test_foreign_file_is_one_clear_line(tmp_path):
    (tmp_path / "notes.pt").write_text("not a checkpoint")
    with pytest.raises(UserError, match="not a torch checkpoint") as err:
        load_file(tmp_path / "notes.pt")
    assert "\n" not in str(err.value)
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(UserError, match="not a ddplab checkpoint"):
        load_file(tmp_path / "other.pt")


class RunsCode:
    """Unpickling this runs a shell command (it pickles as a call to os.system)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


@pytest.mark.parametrize("as_folder", [False, True])
def test_a_pickle_that_runs_code_is_refused(tmp_path, as_folder):
    sentinel = tmp_path / "SENTINEL"
    target = tmp_path / "step-000000001" / STATE if as_folder else tmp_path / "evil.pt"
    target.parent.mkdir(exist_ok=True)
    torch.save({"model": RunsCode(f"touch {sentinel}")}, target)
    assert not sentinel.exists()
    if as_folder:  # a complete-looking snapshot: resume skips it instead of running it
        (target.parent / MARKER).write_text("{}")
        assert Checkpointer(tmp_path, is_main=True).newest(lambda m: None) is None
    else:
        with pytest.raises(UserError, match="could run code"):
            load_file(target)
    assert not sentinel.exists()
    # The same file loaded unsafely does run code: the refusal above is what protects.
    torch.load(target, weights_only=False)
    assert sentinel.exists()
    os.remove(sentinel)
