"""What metrics.json holds: the run's config, data, model, DDP facts, series and aggregates."""

from __future__ import annotations

import hashlib

import torch


def parameter_digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes: equal on all ranks iff DDP kept replicas identical."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def summary(trainer, status: str, workload: dict | None = None, test: dict | None = None) -> dict:
    from ddplab.engine.comm import comm_summary
    from ddplab.engine.state import batch_arithmetic

    cfg, ctx, data, s = trainer.cfg, trainer.ctx, trainer.data, trainer.state
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
    task = data.task.describe()
    return {
        "status": status, "stop_reason": s.stop_reason, "config": cfg.to_dict(),
        "workload": workload or {},
        "dataset": {"name": cfg.data.name, "task": task["kind"], "train": len(data.train),
                    "val": len(data.val) if data.val is not None else 0,
                    "test": len(data.test) if data.test is not None else 0,
                    "num_classes": data.num_classes, "vocab_size": data.vocab_size},
        "model": {"name": cfg.model.name, "parameters": params, "flops_per_token": flops},
        "ddp": {**batch_arithmetic(cfg, ctx.world_size), "backend": ctx.backend, "launcher": ctx.launch.launcher,
                "steps_per_epoch": trainer.steps_per_epoch, "lr": trainer.lr, "lr_scaling": cfg.training.lr_scaling,
                "bucket_cap_mb": cfg.distributed.bucket_cap_mb, "comm_hook": cfg.distributed.comm_hook},
        "comm": comm_summary(trainer.raw, trainer.comm, cfg.distributed),
        "epochs": s.history, "steps": s.steps, "aggregates": aggregates, "test": test or {},
    }
