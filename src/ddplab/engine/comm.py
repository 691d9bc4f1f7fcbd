"""DDP communication hooks: compression (fp16, bf16, PowerSGD) from torch itself."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook


def install_comm_hook(model, dcfg, ctx):
    """Register the configured hook on a DDP model; returns the hook state (kept alive by the trainer)."""
    if dcfg.comm_hook == "none":
        return None
    group = dist.group.WORLD
    if dcfg.comm_hook == "fp16":
        model.register_comm_hook(group, default_hooks.fp16_compress_hook)
        return None
    if dcfg.comm_hook == "bf16":
        model.register_comm_hook(group, default_hooks.bf16_compress_hook)
        return None
    state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                        min_compression_rate=2, random_seed=0)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return state
