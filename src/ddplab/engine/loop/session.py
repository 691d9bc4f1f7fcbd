"""`ddplab train` in one process of the job, one method per stage: rendezvous and lock the run folder -> build the
data and the model -> set up the run folder -> build the trainer (given its parts) -> fit -> record -> end. A failure
is reported once (fail); the teardown (close) releases in the one order that works."""

from __future__ import annotations

import functools
import sys
import time
from typing import NoReturn

import torch
import yaml

from ddplab.config import Config
from ddplab.engine.diagnosis import failure, flight_recorder
from ddplab.engine.diagnosis.heartbeat import Heartbeat, PeerFailed
from ddplab.engine.diagnosis.outcome import listened, report_stopped, tell
from ddplab.engine.diagnosis.phases import Phases
from ddplab.engine.loop.parts import Builders
from ddplab.engine.loop.preemption import STOPS
from ddplab.engine.loop.resume import resume
from ddplab.engine.loop.rng import seed_everything
from ddplab.engine.loop.setup import build_data, build_model
from ddplab.engine.loop.state import TrainState
from ddplab.engine.loop.summary import parameter_digest, summary
from ddplab.engine.loop.trainer import Trainer
from ddplab.engine.parallel import distributed
from ddplab.engine.parallel.distributed import DistContext
from ddplab.engine.parallel.fault_tolerance import NoReplicas
from ddplab.engine.run_folder import assets, env
from ddplab.engine.run_folder.folder import RunFolder
from ddplab.engine.run_folder.lock import own_run_folder
from ddplab.engine.snapshots.fingerprint import check_resume, check_resume_path
from ddplab.errors import ExitCode, LighthouseLost, UserError
from ddplab.runtime import process_state
from ddplab.workload import Data, Workload, reference_file


class Session:
    """`phases` times each stage for metrics.json; `trainer`, `run` and `beat` are set as their stages build
    them, so that the teardown releases what was built and nothing else."""

    def __init__(self, cfg: Config, phases: Phases) -> None:
        self.cfg, self.phases = cfg, phases
        self.kept = process_state.keep_freed_memory() if cfg.training.keep_host_memory else 0  # 0: glibc's defaults
        self.trainer: Trainer | None = None
        self.run: RunFolder | None = None
        self.beat: Heartbeat | None = None
        self.code: dict = {}  # the workload's functions: reference and file, for metrics.json

    def train(self, work: Workload, callbacks: list, trackers, builders: Builders) -> dict:
        """The metrics.json summary. `callbacks`: every callback of the run, in order; `trackers`, one of them,
        ends its runs as failed in the teardown."""
        cfg = self.cfg
        flight_recorder.arm(cfg.distributed.backend)
        with (
            distributed.session(cfg.distributed.backend, cfg.distributed.timeout) as ctx,
            own_run_folder(cfg, ctx, check_resume) as (run_dir, note),
        ):
            self.phases.mark("rendezvous")
            try:
                data, model = self.build(ctx, work)
                run = self.open_run_folder(ctx, run_dir, note, data)
                # No reference to the trainer here: the teardown must be able to let it go before the process group.
                result = self.fit(ctx, run, self.start(ctx, run, work, data, model, callbacks, builders))
            except PeerFailed:  # told by this rank's heartbeat; rank 0 wrote the job's report
                raise SystemExit(ExitCode.FAILED) from None
            except Exception as exc:
                self.fail(ctx, run_dir, exc)
            finally:
                self.close(trackers)
        if ctx.is_main and result["status"] not in STOPS:  # after the process group is gone: teardown counted
            self.phases.add_teardown(run_dir)
        return result

    def build(self, ctx: DistContext, work: Workload) -> tuple[Data, torch.nn.Module]:
        """Data and model first: a start that fails here writes nothing to the run folder."""
        cfg = self.cfg
        seed_everything(cfg.experiment.seed)  # identical init everywhere (DDP also broadcasts rank 0's)
        data = build_data(cfg, ctx, work)
        self.phases.mark("data")
        model = build_model(cfg, ctx, work, data)
        check_resume_path(cfg.checkpoint.resume, model)
        seed_everything(cfg.experiment.seed + ctx.rank)  # distinct dropout streams per rank
        self.phases.mark("model")
        return data, model

    def open_run_folder(self, ctx: DistContext, run_dir, note: str | None, data: Data) -> RunFolder:
        """The run folder in use: its heartbeat started, the config, the environment and the assets written."""
        cfg = self.cfg
        run = self.run = RunFolder(run_dir, ctx.is_main)
        flight_recorder.dump_into(run.path / run.LOGS, ctx.backend)
        # One process alone: its failure reaches the terminal as the exception ddplab.cli prints.
        announce = functools.partial(tell, "failure") if ctx.is_distributed else lambda report: None
        self.beat = Heartbeat(ctx, run, cfg.distributed.stall_warning, announce).start()
        if note:
            run.log(note)
        run.write_text(RunFolder.CONFIG, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        run.write_json(RunFolder.ENV, {**env.collect(ctx), "host_memory_kept_below_bytes": self.kept})
        assets.save(run, data)  # what predict reads in place of the data
        self.phases.mark("run_folder")
        return run

    def start(self, ctx, run: RunFolder, work: Workload, data, model, callbacks, builders: Builders) -> Trainer:
        """The trainer, handed its parts, resumed from the last snapshot; metrics.json says `running`."""
        self.code = {k: {"reference": r, "file": str(reference_file(r) or "")} for k, r in work.references.items()}
        parts = builders.build(self.cfg, ctx, data, model, run.log)
        parts.faults = fault_tolerance(self.cfg, ctx, run)  # replica groups write replicas.csv into the run folder
        trainer = self.trainer = Trainer(self.cfg, ctx, data, parts, run, callbacks)
        resume(trainer)
        self.phases.mark("trainer")
        self.phases.watch_first_step(trainer.view.optimizer, compiles=self.cfg.training.compile)
        run.write_json(RunFolder.METRICS_JSON, summary(trainer.view, "running", self.code))
        return trainer

    def fit(self, ctx: DistContext, run: RunFolder, trainer: Trainer) -> dict:
        """Train, then record the run and end it: its callbacks' on_train_end (a language model's sample first)."""
        start = time.time()
        state = trainer.fit()
        self.phases.mark("training")
        if state.stop_reason in STOPS:  # a signal's stop: the snapshot is saved, the run goes on when rerun
            result = summary(trainer.view, state.stop_reason, self.code)
            run.write_json(RunFolder.METRICS_JSON, result)
            said = "pre-empted" if state.stop_reason == "preempted" else "interrupted"
            run.log(f"{said} after step {state.step}; the same command continues from the snapshot")
            report_stopped(state.stop_reason)  # now, not after the teardown: one that aborts at exit has told
        else:
            result = self.record(ctx, run, trainer, state, start)
        trainer.callbacks.on_train_end(trainer.view, result)
        ctx.beat.mark("end")
        return result

    def record(self, ctx: DistContext, run: RunFolder, trainer: Trainer, state: TrainState, start: float) -> dict:
        """The complete run: tested, its ranks' parameters compared, metrics.json written (wall_time_s: from
        `start`, fit's, to here), its `done:` line."""
        view = trainer.view
        digests = ctx.gather_objects(parameter_digest(view.model))
        if len(set(digests)) > 1:
            run.log(f"WARNING: parameters differ between ranks after training: {digests}")
        result = summary(view, "complete", self.code, test=trainer.test())
        result["ddp"].update(parameter_digests=digests, ranks_identical=len(set(digests)) == 1)
        result["wall_time_s"] = time.time() - start
        self.phases.mark("end_of_run")
        result["phases"] = self.phases.as_dict()
        run.write_json(RunFolder.METRICS_JSON, result)
        epochs = f"{state.epoch} epochs"
        if state.history and state.history[-1].get("partial"):
            data = f" ({state.step / view.steps_per_epoch:.2f} epochs of data)" if view.steps_per_epoch else ""
            epochs += f" + 1 partial{data}"
        run.log(
            f"done: {state.stop_reason}; {epochs}, {state.step} steps; "
            f"best val loss {result['aggregates'].get('best_val_loss')}; run folder {run.path}"
        )
        return result

    def fail(self, ctx: DistContext, run_dir, exc: Exception) -> NoReturn:
        """Bad input found before anything was written goes up as it is (one line, exit 2); any other failure
        is said once, recorded in the run folder, and ends this process (exit 1)."""
        if isinstance(exc, UserError) and self.run is None:
            raise exc
        error, known = failure.as_run_error(exc, run_dir)
        # Each rank's own, but a failure outside the job's processes (the Lighthouse), which no rank caused.
        line = (
            f"rank {ctx.rank}: {error}" if ctx.world_size > 1 and not isinstance(error, LighthouseLost) else str(error)
        )
        # Plain torchrun: ranks' output interleaves, so each says whose, at once (what rank 0 announces
        # below is this same line when its cause is known, or when it failed before the heartbeat began).
        if ctx.is_distributed and not listened() and not (ctx.is_main and (known or self.beat is None)):
            print(f"ddplab: failed: {line}", file=sys.stderr, flush=True)
        if self.beat is not None:  # the report; the traceback goes to logs/rank<N>.log
            self.beat.fail(exc, f"failed: {line}", known)
        else:
            failure.record(run_dir, ctx.rank, exc, line)
            if ctx.is_distributed and ctx.is_main:
                tell("failure", f"failed: {line}")
        if ctx.is_distributed:
            raise SystemExit(ExitCode.FAILED) from None
        if error is exc:
            raise exc
        raise error from exc

    def close(self, trackers) -> None:
        """The heartbeat, the trackers (after a failure their runs end as failed, their files flushed), then the
        trainer: gloo aborts unless the DDP model and the optimizer are gone before the process group. Then the
        run folder's log."""
        if self.beat is not None:
            self.beat.stop()
        trackers.close()
        if self.trainer is not None:
            self.trainer.close()
            self.trainer = None
        if self.run is not None:
            self.run.close()


def fault_tolerance(cfg, ctx, run) -> NoReplicas:
    """The mode distributed.fault_tolerance names: replica groups (torchft, imported only then) or none."""
    if cfg.distributed.fault_tolerance != "replicas":
        return NoReplicas()
    from ddplab.engine.parallel.replicas import Replicas  # torchft is optional: imported only in this mode

    return Replicas(cfg, ctx, run.log, run.path)
