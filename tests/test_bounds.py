"""Resources bounded before they are spent: a count no machine holds is refused in one line, a large legal one is
cut to what this machine holds, with a line. Nothing here starts a loader worker or allocates what it checks, so
a regression fails the test instead of taking the machine down."""

from __future__ import annotations

import pytest

from ddplab.config import MAX_PROCESSES
from ddplab.config_io import read_config
from ddplab.data.checks import check_memory, memory_bytes
from ddplab.engine import loaders
from ddplab.errors import UserError
from ddplab.registry import replica_place


@pytest.mark.parametrize("key", ["data.num_workers", "distributed.replica_groups"])
def test_a_process_count_no_machine_holds_is_refused_naming_the_field(key):
    with pytest.raises(UserError, match=key.replace(".", r"\.")):
        read_config(None, [f"{key}={10**12}"])
    read_config(None, [f"{key}={MAX_PROCESSES}"])  # the largest count is read, then bounded by the machine


def test_replica_groups_from_the_environment_are_bounded_too():
    cfg = read_config(None, ["distributed.fault_tolerance=replicas"])
    with pytest.raises(UserError, match="NUM_REPLICA_GROUPS"):
        replica_place(cfg, {"NUM_REPLICA_GROUPS": str(10**12), "REPLICA_GROUP_ID": "0"})


def test_loader_workers_are_cut_to_four_a_core_with_a_line(monkeypatch):
    monkeypatch.setattr(loaders, "_cores", lambda: 2)
    assert loaders.bounded_workers(8, 1) == (8, None)
    workers, line = loaders.bounded_workers(100_000, 1)
    assert workers == 8 and "data.num_workers=100000 cut to 8" in line and "4 per core" in line
    assert loaders.bounded_workers(100_000, 2)[0] == 4  # two ranks share the two cores


def test_loader_workers_are_cut_to_what_memory_holds(monkeypatch):
    monkeypatch.setattr(loaders, "_cores", lambda: 64)
    gib = 2**30
    sizes = {"MemAvailable": 10 * gib, "Private_Dirty": gib, "Private_Clean": 0}
    monkeypatch.setattr(loaders, "_meminfo", sizes.get)
    workers, line = loaders.bounded_workers(100, 2)
    assert workers == 5 and "available memory" in line  # 10 GiB over 2 ranks at 1 GiB a worker


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["data.name=synthetic_reviews", "model.name=transformer", f"data.vocab_size={10**12}"], "data.vocab_size"),
        (["data.name=synthetic", "model.name=cnn", f"data.num_samples={10**12}"], "data.num_samples"),
        (["data.name=synthetic", "model.name=cnn", f"data.num_classes={10**12}"], "data.num_classes"),
    ],
)
def test_a_size_that_cannot_fit_in_memory_is_refused_before_it_is_allocated(overrides, field):
    if memory_bytes() is None:
        pytest.skip("this OS does not say how much memory it has")
    with pytest.raises(UserError, match=rf"^{field}=1000000000000: .* needs .*; this machine has"):
        check_memory(read_config(None, overrides))


def test_a_size_that_fits_is_accepted():
    check_memory(read_config(None, ["data.name=synthetic_reviews", "model.name=transformer"]))
