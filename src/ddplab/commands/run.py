"""`ddplab train` in one process of the job: the config's workload and callbacks, resolved here once, handed to an
engine Session (engine/loop/session.py), which sets up, fits, records and tears down."""

from __future__ import annotations

from ddplab.callbacks import configured
from ddplab.commands.trained_model import LanguageSample
from ddplab.config import Config
from ddplab.config.frozen import freeze
from ddplab.engine.diagnosis.phases import Phases
from ddplab.engine.loop.parts import Builders
from ddplab.engine.loop.session import Session
from ddplab.errors import disk_full, write_failed
from ddplab.metrics.callbacks import RunRecorder, column_callbacks
from ddplab.metrics.class_report import ClassReports
from ddplab.registry import workload
from ddplab.runtime import process_state
from ddplab.trackers import Trackers
from ddplab.workload import remember_code


def train(cfg: Config, data_fn=None, model_fn=None, callbacks=(), builders: Builders | None = None) -> dict:
    """Train under whatever launcher started this process; returns the metrics.json summary. `callbacks` run after
    ddplab's own column makers, before the recorder; `cfg` is frozen here if its loader has not (ddplab.train())."""
    phases = Phases()
    trackers = Trackers(cfg.logging.trackers)
    with process_state.changes():  # a notebook calling train() again finds its process as it was
        try:
            work = workload(cfg, data_fn, model_fn)
            remember_code(work.references.values())  # what predict and generate may import again without asking
            phases.mark("workload")  # importing its functions' modules (a built-in image workload: torchvision)
            freeze(cfg)
            every = [LanguageSample(), *column_callbacks(), ClassReports(), *configured(cfg.training), *callbacks]
            process_state.freeze_gc()
            process_state.tf32(cfg.training.tf32)
            session = Session(cfg, phases)
            return session.train(work, [*every, RunRecorder(), trackers], trackers, builders or Builders())
        except OSError as exc:  # a full disk anywhere (a tracker's flush at teardown too): one line, exit 1
            if disk_full(exc) is None:
                raise
            raise write_failed(exc.filename or cfg.experiment.output_dir, exc) from exc
