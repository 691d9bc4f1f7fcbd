"""RunFiles: the one reader of run folders (status, reports, studies, verify, workloads)."""

from __future__ import annotations

import json

from ddplab.engine.run_folder.folder import RunFiles


def _run(folder, status: str = "complete"):
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps({"status": status}))
    return folder


def test_runs_are_found_around_a_path_and_under_a_folder_once_each(tmp_path):
    one, two = _run(tmp_path / "study" / "a"), _run(tmp_path / "study" / "b", "running")
    _run(one / "checkpoints" / "best")  # a snapshot's folder is no run of its own
    (tmp_path / "study" / "c").symlink_to(one)  # nor is a second path to the same run
    assert [r.path for r in RunFiles.under(tmp_path / "study")] == [one, two]
    assert [r.path for r in RunFiles.under(one)] == [one]
    assert RunFiles.around(one / "checkpoints" / "step-000000004" / "state.pt").path == one
    assert RunFiles.around(tmp_path / "study" / "x.csv") is None
    assert RunFiles(one).finished() and not RunFiles(two).finished()


def test_an_unreadable_or_foreign_summary_reads_as_none(tmp_path):
    run = _run(tmp_path / "r")
    for text in ("{not json", "[1, 2]"):
        (run / "metrics.json").write_text(text)
        assert RunFiles(run).exists() and RunFiles(run).summary() is None and not RunFiles(run).finished()
    assert RunFiles(tmp_path / "none").summary() is None
    assert RunFiles(run).heartbeat() == {} and RunFiles(run).point() == {} and RunFiles(run).quorum_steps() == []
