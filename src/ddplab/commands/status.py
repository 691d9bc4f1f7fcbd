"""`ddplab status RUN`: for requeue scripts under plain torchrun, whose own exit code cannot say 'pre-empted'."""

from __future__ import annotations

import json
from pathlib import Path

from ddplab.errors import ExitCode, UserError


def main(ns) -> int:
    path = Path(ns.run) / "metrics.json"
    if not path.is_file():
        raise UserError(f"no run folder at {ns.run} (no metrics.json)")
    try:
        status = json.loads(path.read_text()).get("status", "unknown")
    except (OSError, ValueError, AttributeError):
        raise UserError(f"{path} is not a ddplab metrics.json") from None
    print(status)
    return {"complete": ExitCode.OK, "preempted": ExitCode.PREEMPTED}.get(status, ExitCode.FAILED)
