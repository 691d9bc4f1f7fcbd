"""`ddplab train` in one process of the job: set up, fit, record, tear down."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import torch

from ddplab import distributed
from ddplab.config import Config, dump_yaml
from ddplab.data import build_data
from ddplab.engine.checkpoint import BEST, load_file
from ddplab.engine.hostmem import keep_freed_memory
from ddplab.engine.rng import seed_everything
from ddplab.engine.trainer import Trainer, batch_arithmetic
from ddplab.errors import UserError
from ddplab.metrics import env as env_info
from ddplab.metrics.run_folder import RunFolder
from ddplab.models import build_model


def finished(run_dir: Path) -> bool:
    """A run that ended by itself; a crashed ("running") or pre-empted one is continued instead."""
    try:
        return json.loads((run_dir / "metrics.json").read_text()).get("status") == "complete"
    except (OSError, ValueError):
        return False


def resolve_run_dir(cfg: Config) -> tuple[Path, str | None]:
    """experiments/<name>; a folder holding a finished run is kept, and the new run gets <name>-2, -3, ..."""
    base = Path(cfg.experiment.output_dir) / cfg.run_name()
    if cfg.checkpoint.resume != "never" and not finished(base):
        return base, None
    if not base.exists():
        return base, None
    i = 2
    while Path(f"{base}-{i}").exists() and (finished(Path(f"{base}-{i}")) or cfg.checkpoint.resume == "never"):
        i += 1
    return Path(f"{base}-{i}"), f"{base} holds a finished run; this run writes {base}-{i}"


def train(cfg: Config) -> dict:
    """Train under whatever launcher started this process; returns the metrics.json summary."""
    kept = keep_freed_memory() if cfg.training.keep_host_memory else 0
    with distributed.session(cfg.distributed.backend, cfg.distributed.timeout) as ctx:
        decision = resolve_run_dir(cfg) if ctx.is_main else None
        run_dir, note = ctx.broadcast_object(decision)
        run = RunFolder(run_dir, ctx.is_main, tensorboard=cfg.logging.tensorboard)
        trainer = None
        try:
            if note:
                run.log(note)
            run.write_text("config.yaml", dump_yaml(cfg))
            environment = env_info.collect(ctx)
            environment["host_memory_kept_below_bytes"] = kept  # 0: glibc's defaults
            run.write_json("env.json", environment)
            seed_everything(cfg.experiment.seed)  # identical init everywhere (DDP also broadcasts rank 0's)
            bundle = build_data(cfg, ctx)
            model = build_model(cfg, bundle)
            seed_everything(cfg.experiment.seed + ctx.rank)  # distinct dropout streams per rank
            trainer = Trainer(cfg, ctx, bundle, model, run)
            trainer.resume()
            summary = _summary(cfg, ctx, bundle, trainer, status="running")
            run.write_json("metrics.json", summary)
            start = time.time()
            state = trainer.fit()
            if state.stop_reason == "preempted":
                summary = _summary(cfg, ctx, bundle, trainer, status="preempted")
                run.write_json("metrics.json", summary)
                run.log(f"pre-empted after step {state.step}; the same command continues from the snapshot")
                return summary
            digests = ctx.gather_objects(parameter_digest(trainer.raw))
            if len(set(digests)) > 1:
                run.log(f"WARNING: parameters differ between ranks after training: {digests}")
            test = _test_best(trainer, run_dir)
            summary = _summary(cfg, ctx, bundle, trainer, status="complete", test=test)
            summary["ddp"]["parameter_digests"] = digests
            summary["ddp"]["ranks_identical"] = len(set(digests)) == 1
            summary["wall_time_s"] = time.time() - start
            run.write_json("metrics.json", summary)
            run.log(f"done: {state.stop_reason}; {state.epoch} epochs, {state.step} steps; "
                    f"best val loss {summary['aggregates'].get('best_val_loss')}; run folder {run_dir}")
            if ctx.is_main and bundle.task == "lm" and cfg.generate.max_new_tokens > 0:
                from ddplab.generate import sample

                text = sample(trainer.raw, bundle.meta, cfg.generate.prompt, cfg.generate.max_new_tokens,
                              cfg.generate.temperature, cfg.generate.top_k, seed=cfg.experiment.seed)
                (run_dir / "sample.txt").write_text(text)
                run.log("sample:\n" + text)
            return summary
        except Exception as exc:
            if ctx.is_distributed and not isinstance(exc, UserError):  # ranks' output interleaves: say whose
                print(f"ddplab: rank {ctx.rank} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            raise
        finally:
            if trainer is not None:
                trainer.close()
            del trainer
            run.close()


def parameter_digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes: equal on all ranks iff DDP kept replicas identical."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _test_best(trainer: Trainer, run_dir: Path) -> dict:
    """Evaluate the best model (by validation loss) on the test split."""
    if trainer.bundle.test is None:
        return {}
    best = run_dir / "checkpoints" / BEST
    trainer.ctx.barrier()
    if best.is_file():
        trainer.raw.load_state_dict(load_file(best)["model"])
    return trainer.test()


def _summary(cfg: Config, ctx, bundle, trainer: Trainer, status: str, test: dict | None = None) -> dict:
    s = trainer.state
    full = [r for r in s.history if not r.get("partial")]
    times = [r["epoch_time_s"] for r in full if r.get("epoch_time_s")]
    rates = [r["samples_per_s"] for r in full if r.get("samples_per_s")]
    last = s.history[-1] if s.history else {}
    aggregates = {
        "epochs_completed": s.epoch, "steps": s.step, "train_time_s": s.elapsed, "resumes": s.resumes,
        "time_budget_s": trainer.budget,
        "mean_epoch_time_s": sum(times) / len(times) if times else None,
        "mean_samples_per_s": sum(rates) / len(rates) if rates else None,
        "best_val_loss": s.best_val_loss if s.best_epoch else None, "best_epoch": s.best_epoch,
        "final_train_loss": last.get("train_loss"), "final_val_loss": last.get("val_loss"),
        "final_val_accuracy": last.get("val_accuracy"),
    }
    params = sum(p.numel() for p in trainer.raw.parameters())
    flops = trainer.raw.flops_per_token() if hasattr(trainer.raw, "flops_per_token") else None
    return {
        "status": status, "stop_reason": s.stop_reason, "config": cfg.to_dict(),
        "dataset": {"name": cfg.data.name, "task": bundle.task, "train": len(bundle.train),
                    "val": len(bundle.val) if bundle.val is not None else 0,
                    "test": len(bundle.test) if bundle.test is not None else 0,
                    "num_classes": bundle.num_classes, "vocab_size": bundle.vocab_size},
        "model": {"name": cfg.model.name, "parameters": params, "flops_per_token": flops},
        "ddp": {**batch_arithmetic(cfg, ctx.world_size), "backend": ctx.backend, "launcher": ctx.launch.launcher,
                "steps_per_epoch": trainer.steps_per_epoch, "lr": trainer.lr, "lr_scaling": cfg.training.lr_scaling,
                "bucket_cap_mb": cfg.distributed.bucket_cap_mb, "comm_hook": cfg.distributed.comm_hook},
        "epochs": s.history, "steps": s.steps, "aggregates": aggregates, "test": test or {},
    }
