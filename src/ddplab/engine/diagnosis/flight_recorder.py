"""NCCL's flight recorder: each rank's last collectives, dumped into the run's logs/ when one times out.

torch records them, but dumps them only when asked, and into /tmp. On NCCL, ddplab asks for the
dump on a timeout, into logs/nccl_trace_rank<N> of the run folder, unless the user set these
variables; the failure report then names, for each rank that dumped, the first collective it
entered and never completed. torch reads the switch when the process group is made and the file
name when it dumps: hence two calls, before the group and once the run folder is known."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.flight_recorder.components.loader import read_dump

from ddplab.engine.parallel.distributed import pick_backend
from ddplab.engine.run_folder.files import subfolder
from ddplab.runtime import process_state

PREFIX = "nccl_trace_rank_"  # + the rank: torch's name for the file
_BUFFER = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # each pair: torch's newer name first
_FILE = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def arm(backend: str) -> None:
    """Before the process group is made: record (torch before 2.14 did not by default), dump on a timeout."""
    if pick_backend(backend, torch.cuda.is_available()) == "nccl":
        process_state.env_default(_BUFFER, "2000")
        process_state.env_default("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")


def dump_into(logs: Path, backend: str | None) -> None:
    """Once the run folder is known and valid: the dumps go beside the ranks' stacks."""
    if backend == "nccl" and not os.environ.keys() & set(_FILE):
        subfolder(logs.parent, logs.name)  # torch writes the dumps: never into a link to elsewhere
        process_state.env_default(_FILE, str(logs / PREFIX))


def unfinished(since: float) -> dict[int, dict]:
    """rank -> the first collective it entered and never completed, from the dumps written after `since`."""
    prefix = next((Path(os.environ[n]) for n in _FILE if os.environ.get(n)), None)
    found: dict[int, dict] = {}
    if prefix is None:
        return found
    for path in prefix.parent.glob(prefix.name + "*"):
        try:
            if path.stat().st_mtime < since:
                continue  # an earlier attempt's
            dump: dict[str, Any] = read_dump(prefix.name, str(path))  # its format says which value is which type
        except Exception:  # a dump cut short, or not one: the report goes on without it
            continue
        # gloo never marks an entry completed, only retired; a timed-out NCCL entry is neither.
        for e in sorted(dump["entries"], key=lambda e: e["record_id"]):
            if not e.get("retired") and e.get("state") != "completed":
                found[dump["rank"]] = {
                    "collective": e["profiling_name"],
                    "group": e["process_group"][1] or e["process_group"][0],
                    "seq": e["p2p_seq_id" if e["is_p2p"] else "collective_seq_id"],
                    "sizes": e["input_sizes"],
                    "state": e["state"],
                }
                break
    return found
