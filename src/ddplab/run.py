"""`ddplab train` in one process of the job: set up, fit, record, tear down."""

from __future__ import annotations

import sys
import time

import yaml

from ddplab import distributed, process_state
from ddplab.callbacks import configured
from ddplab.config import Config
from ddplab.engine import assets, failure, flight_recorder
from ddplab.engine.fingerprint import check_resume_path
from ddplab.engine.heartbeat import Heartbeat, PeerFailed
from ddplab.engine.lock import own_run_folder, resolve_run_dir
from ddplab.engine.rng import seed_everything
from ddplab.engine.run_folder import RunFolder
from ddplab.engine.setup import build_data, build_model
from ddplab.engine.trainer import Trainer
from ddplab.errors import ExitCode, UserError, disk_full, write_failed
from ddplab.inference import sample
from ddplab.launch import listened, report_failure, report_preempted
from ddplab.metrics import env as env_info
from ddplab.metrics.callbacks import RunRecorder, column_callbacks
from ddplab.metrics.class_report import ClassReports
from ddplab.metrics.phases import Phases
from ddplab.metrics.summary import parameter_digest, summary
from ddplab.registry import workload
from ddplab.trackers import Trackers
from ddplab.workload import reference_file, remember_code


def train(cfg: Config, data_fn=None, model_fn=None, callbacks=()) -> dict:
    """Train under whatever launcher started this process; returns the metrics.json summary.

    `data_fn` / `model_fn` take the place of data.name / model.name (ddplab.train() passes them);
    `callbacks` run after ddplab's own column makers and before the recorder.
    """
    with process_state.changes():  # a notebook calling train() again finds its process as it was
        process_state.freeze_gc()
        process_state.tf32(cfg.training.tf32)
        try:
            return _train(cfg, data_fn, model_fn, callbacks)
        except OSError as exc:  # a full disk anywhere (a tracker's flush at teardown too): one line, exit 1
            if disk_full(exc) is None:
                raise
            raise write_failed(exc.filename or cfg.experiment.output_dir, exc) from exc


def _train(cfg: Config, data_fn, model_fn, callbacks) -> dict:
    phases = Phases()
    kept = process_state.keep_freed_memory() if cfg.training.keep_host_memory else 0  # 0: glibc's defaults
    work = workload(cfg, data_fn, model_fn)
    remember_code(work.references.values())  # what predict and generate may import again without asking
    phases.mark("workload")  # importing its functions' modules (a built-in image workload: torchvision)
    flight_recorder.arm(cfg.distributed.backend)
    with (
        distributed.session(cfg.distributed.backend, cfg.distributed.timeout) as ctx,
        own_run_folder(cfg, ctx, resolve_run_dir) as (run_dir, note),
    ):
        phases.mark("rendezvous")
        trainer = run = view = beat = None
        trackers = Trackers(cfg.logging.trackers)
        try:
            # Data and model first: a start that fails here writes nothing to the run folder.
            seed_everything(cfg.experiment.seed)  # identical init everywhere (DDP also broadcasts rank 0's)
            data = build_data(cfg, ctx, work)
            phases.mark("data")
            model = build_model(cfg, ctx, work, data)
            check_resume_path(cfg, model)
            seed_everything(cfg.experiment.seed + ctx.rank)  # distinct dropout streams per rank
            phases.mark("model")
            run = RunFolder(run_dir, ctx.is_main)
            flight_recorder.dump_into(run.path / run.LOGS, ctx.backend)
            # One process alone: its failure reaches the terminal as the exception ddplab.cli prints.
            beat = Heartbeat(
                ctx, run, cfg.distributed.stall_warning, _announce if ctx.is_distributed else _quiet
            ).start()
            if note:
                run.log(note)
            run.write_text(RunFolder.CONFIG, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            run.write_json(RunFolder.ENV, {**env_info.collect(ctx), "host_memory_kept_below_bytes": kept})
            assets.save(run, data)  # what predict reads in place of the data
            phases.mark("run_folder")
            code = {k: {"reference": ref, "file": str(reference_file(ref) or "")} for k, ref in work.references.items()}
            trainer = Trainer(
                cfg,
                ctx,
                data,
                model,
                run,
                callbacks=[*column_callbacks(), ClassReports(), *configured(cfg), *callbacks, RunRecorder(), trackers],
            )
            view = trainer.view
            trainer.resume()
            phases.mark("trainer")
            phases.watch_first_step(view.optimizer, compiles=cfg.training.compile)
            run.write_json(RunFolder.METRICS_JSON, summary(view, "running", code))
            start = time.time()
            state = trainer.fit()
            phases.mark("training")
            if state.stop_reason == "preempted":
                result = summary(view, "preempted", code)
                run.write_json(RunFolder.METRICS_JSON, result)
                run.log(f"pre-empted after step {state.step}; the same command continues from the snapshot")
                report_preempted()  # now, not after the teardown: a process that aborts at exit has told the launcher
                trainer.end(result)
                return result
            digests = ctx.gather_objects(parameter_digest(view.model))
            if len(set(digests)) > 1:
                run.log(f"WARNING: parameters differ between ranks after training: {digests}")
            result = summary(view, "complete", code, test=trainer.test())
            result["ddp"].update(parameter_digests=digests, ranks_identical=len(set(digests)) == 1)
            result["wall_time_s"] = time.time() - start
            phases.mark("end_of_run")
            result["phases"] = phases.as_dict()
            run.write_json(RunFolder.METRICS_JSON, result)
            partial = bool(state.history and state.history[-1].get("partial"))
            epochs = f"{state.epoch} epochs" + (
                f" + 1 partial ({state.step / view.steps_per_epoch:.2f} epochs of data)"
                if partial and view.steps_per_epoch
                else " + 1 partial"
                if partial
                else ""
            )
            run.log(
                f"done: {state.stop_reason}; {epochs}, {state.step} steps; "
                f"best val loss {result['aggregates'].get('best_val_loss')}; run folder {run_dir}"
            )
            # Sharded, every rank takes part in each forward pass; rank 0 writes.
            if (
                (ctx.is_main or cfg.distributed.strategy != "ddp")
                and data.meta.get("tokenizer") in ("char", "byte")
                and cfg.generate.max_new_tokens > 0
            ):
                text = sample(
                    view.model,
                    data.meta,
                    cfg.generate.prompt,
                    cfg.generate.max_new_tokens,
                    cfg.generate.temperature,
                    cfg.generate.top_k,
                    seed=cfg.experiment.seed,
                )
                run.write_text(RunFolder.SAMPLE, text)
                run.log("sample:\n" + text)
            trainer.end(result)
            ctx.beat.mark("end")
        except PeerFailed:  # told by this rank's heartbeat; rank 0 wrote the job's report
            raise SystemExit(ExitCode.FAILED) from None
        except Exception as exc:
            if isinstance(exc, UserError) and run is None:
                raise  # bad input, found before anything was written: one line, exit 2
            error, known = failure.as_run_error(exc, run_dir)
            line = f"rank {ctx.rank}: {error}" if ctx.world_size > 1 else str(error)
            # Plain torchrun: ranks' output interleaves, so each says whose, at once (what rank 0 announces
            # below is this same line when its cause is known, or when it failed before the heartbeat began).
            if ctx.is_distributed and not listened() and not (ctx.is_main and (known or beat is None)):
                print(f"ddplab: failed: {line}", file=sys.stderr, flush=True)
            if beat is not None:  # the report; the traceback goes to logs/rank<N>.log
                beat.fail(exc, f"failed: {line}", known)
            else:
                failure.record(run_dir, ctx.rank, exc, line)
                if ctx.is_distributed and ctx.is_main:
                    _announce(f"failed: {line}")
            if ctx.is_distributed:
                raise SystemExit(ExitCode.FAILED) from None
            if error is exc:
                raise
            raise error from exc
        finally:
            if beat is not None:
                beat.stop()
            trackers.close()  # after a failure: the trackers' runs end as failed, their files flushed
            if trainer is not None:
                trainer.close()
            del trainer, view
            if run is not None:
                run.close()
    if ctx.is_main:  # after the process group is gone: teardown is counted too
        phases.add_teardown(run_dir)
    return result


def _quiet(report: str) -> None:
    pass


def _announce(report: str) -> None:
    """The terminal's copy of a failure report: once, by the ddplab launcher when one listens."""
    if not report_failure(report):
        print(f"ddplab: {report}", file=sys.stderr, flush=True)
