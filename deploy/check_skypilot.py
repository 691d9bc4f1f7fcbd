"""deploy/skypilot.yaml read by SkyPilot's own task loader and schema (`make deploy-check` runs this with the
pinned skypilot in a venv of its own), and broken copies that the schema must refuse."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import sky
from sky import exceptions

TASK = Path(__file__).with_name("skypilot.yaml")
BROKEN = {  # what is replaced: the schema names the field
    "a misspelled field": ("num_nodes:", "num_node:"),
    "a storage mode SkyPilot lacks": ("mode: MOUNT_CACHED", "mode: SOMETIMES"),
}


def main() -> int:
    task = sky.Task.from_yaml(str(TASK))
    if task.num_nodes < 2 or "/runs" not in task.storage_mounts:
        print(f"{TASK}: SkyPilot reads {task.num_nodes} node(s), mounts {sorted(task.storage_mounts)}")
        return 1
    text = TASK.read_text()
    for what, (old, new) in BROKEN.items():
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as copy:
            copy.write(text.replace(old, new))
            copy.flush()
            try:
                sky.Task.from_yaml(copy.name)
            except exceptions.InvalidSkyPilotConfigError as err:
                print(f"skypilot {sky.__version__} refuses {what}: {str(err).splitlines()[0]}")
                continue
        print(f"{TASK} with {what} ({new!r}): SkyPilot accepted it")
        return 1
    print(f"skypilot {sky.__version__}: {TASK} is a valid task, {task.num_nodes} nodes, the run folder mounted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
