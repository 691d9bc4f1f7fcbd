"""What ddplab's launcher tells the workers it starts, through torchrun's environment: the whole channel, one
DDPLAB_ variable per field of `Handoff`. None is trusted alone: the lock's two are believed only when the
launcher above the worker holds that lock (engine/run_folder/lock.py's launcher_lock)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

PREFIX = "DDPLAB_"


@dataclass(frozen=True)
class Handoff:
    report_dir: str | None = None  # where workers leave errors, failure reports and pre-emption for the launcher
    locked_run: str | None = None  # the run folder whose lock the launcher holds for its workers
    lock_token: str | None = None  # ... and the token written in that lock's holder file
    launched_at: float | None = None  # when the launcher process started (time.time()): the launcher_s phase

    @staticmethod
    def variable(field: str) -> str:
        return PREFIX + field.upper()

    def env(self) -> dict[str, str]:
        """The variables of the fields that are set, for the environment of the processes started next."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {self.variable(k): repr(v) if isinstance(v, float) else v for k, v in values.items() if v is not None}

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> Handoff:
        """What this process was told (os.environ unless `environ`); a value that does not parse is unset."""
        environ = os.environ if environ is None else environ
        values: dict = {f.name: environ.get(cls.variable(f.name)) or None for f in dataclasses.fields(cls)}
        try:
            values["launched_at"] = float(values["launched_at"]) if values["launched_at"] else None
        except ValueError:
            values["launched_at"] = None
        return cls(**values)
