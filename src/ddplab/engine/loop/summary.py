"""What metrics.json holds: the run's config, data, model, DDP facts, series and aggregates."""

from __future__ import annotations

import hashlib

import torch

from ddplab.data.stream import size
from ddplab.engine.loop.setup import digest, stochastic_parts
from ddplab.engine.parallel.ddp_comm import comm_summary
from ddplab.engine.parallel.sharding import fsdp_units, state_bytes


def parameter_digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes: equal on all ranks iff DDP kept replicas identical (a
    collective under fsdp/hsdp: sharded parameters are gathered whole)."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        digest({name: p.full_tensor() if hasattr(p, "full_tensor") else p}, h)
    return h.hexdigest()[:16]


def summary(view, status: str, workload: dict | None = None, test: dict | None = None) -> dict:
    """`view`: the trainer's TrainView."""
    cfg, dist, data, history = view.config, view.dist, view.data, view.history
    full = [r for r in history if not r.get("partial")]
    times = [r["epoch_time_s"] for r in full if r.get("epoch_time_s")]
    rates = [r["samples_per_s"] for r in full if r.get("samples_per_s")]
    last = history[-1] if history else {}
    best_val_loss, best_epoch = view.best
    aggregates = {
        "epochs_completed": view.epochs_completed,
        "steps": view.step,
        "train_time_s": view.elapsed,
        "resumes": view.resumes,
        # The rows' snapshots and the one after the last row (the end of training or a stop), which neither a row
        # nor train_time_s holds: train_time_s is the clock a resumed run goes on from, saved as that snapshot began.
        "snapshot_time_s": sum(r.get("snapshot_time_s") or 0.0 for r in history) + view.snapshot_time,
        "time_budget_s": view.time_budget_s,
        "mean_epoch_time_s": sum(times) / len(times) if times else None,
        "mean_samples_per_s": sum(rates) / len(rates) if rates else None,
        "best_val_loss": best_val_loss if best_epoch else None,
        "best_epoch": best_epoch,
        "final_train_loss": last.get("train_loss"),
        "final_val_loss": last.get("val_loss"),
        "final_val_accuracy": last.get("val_accuracy"),
    }
    model = view.model
    flops = model.flops_per_token() if hasattr(model, "flops_per_token") else None
    return {
        "status": status,
        "stop_reason": view.stop_reason,
        "config": cfg.to_dict(),
        "workload": workload or {},
        # None: a stream that does not know its length
        "dataset": {
            "name": cfg.data.name,
            "task": data.task.describe()["kind"],
            "train": size(data.train),
            "val": size(data.val) if data.val is not None else 0,
            "test": size(data.test) if data.test is not None else 0,
            "num_classes": data.num_classes,
            "vocab_size": data.vocab_size,
        },
        "model": {
            "name": cfg.model.name,
            "parameters": sum(p.numel() for p in model.parameters()),
            "flops_per_token": flops,
            "stochastic": stochastic_parts(model, data),
            "loss_average": view.loss_average,  # items | samples[, each with many targets] (tasks.Task.items)
        },
        "ddp": {
            **view.batch,
            "backend": dist.backend,
            "launcher": dist.launch.launcher,
            "lr": view.lr,
            "lr_scaling": cfg.training.lr_scaling,
            "bucket_cap_mb": cfg.distributed.bucket_cap_mb,
            "comm_hook": cfg.distributed.comm_hook,
            "strategy": cfg.distributed.strategy,
            "state_bytes_per_rank": state_bytes(model, view.optimizer),
            "snapshot_stalls": list(view.snapshot_stalls),
        },
        "comm": {
            **comm_summary(model, view.comm, cfg.distributed),
            "units": fsdp_units(model, cfg.distributed.shard_min_params),
        },
        "epochs": list(history),
        "steps": list(view.log_rows),
        "aggregates": aggregates,
        "test": test or {},
        "eta": eta_record(history, view.elapsed),
        "data_notes": list(view.data_notes),  # a stream's measured length, a resume not exact, data changed
    }


def eta_record(history, actual_end_s: float) -> dict:
    """Each epoch's estimate of the end of training beside the actual end: how far off the ETA was."""
    estimates = [
        {
            "epoch": r["epoch"],
            "eta_s": r["eta_s"],
            "predicted_end_s": r["predicted_end_s"],
            "error": r["predicted_end_s"] / actual_end_s - 1 if actual_end_s else None,
        }
        for r in history
        if r.get("predicted_end_s") is not None
    ]
    return {"actual_end_s": actual_end_s, "estimates": estimates}
