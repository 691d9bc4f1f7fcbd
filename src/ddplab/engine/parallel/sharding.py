"""Sharded training, distributed.strategy=fsdp | hsdp, with PyTorch's FSDP2 (`fully_shard`, in place).

fsdp shards parameters, gradients and optimizer state over every process; hsdp shards within a node and replicates
across nodes (a replicate x shard mesh). Blocks are sharded first and the root last, so one block's parameters are
gathered at a time: the modules the model names in `_no_split_modules` (as Hugging Face models declare them), else
every child of at least distributed.shard_min_params parameters, or what the workload's `shard(model, mesh)` does.
"""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, TypeGuard

import torch
from torch.nn.parallel import DistributedDataParallel

from ddplab.engine.parallel.torch_internals import uncompiled
from ddplab.engine.snapshots.write import SHARDED, part
from ddplab.errors import UserError
from ddplab.workload import resolve

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule


def _is_fsdp(module: torch.nn.Module) -> TypeGuard[FSDPModule]:
    """Whether FSDP2 shards `module`. torch's FSDP (with DTensor and DCP) costs about a second of every process's
    start, so only sharded runs import it; until one has, no module can be an FSDPModule."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def shard(model: torch.nn.Module, cfg, ctx) -> torch.nn.Module:
    """The model sharded in place over the job's device mesh (a plain module on one process)."""
    from torch.distributed.device_mesh import init_device_mesh  # FSDP: only for sharded runs (see _is_fsdp)
    from torch.distributed.fsdp import fully_shard

    d, per_node = cfg.distributed, ctx.launch.local_world_size
    model.to(ctx.device)
    if not ctx.is_distributed:
        return model
    if d.strategy == "hsdp":
        if ctx.world_size % per_node:
            raise UserError(
                f"distributed.strategy=hsdp replicates across nodes: the world size {ctx.world_size} "
                f"must be a multiple of the {per_node} processes per node"
            )
        mesh = init_device_mesh(
            ctx.device.type, (ctx.world_size // per_node, per_node), mesh_dim_names=("replicate", "shard")
        )
    else:
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    policy = precision(cfg.training.amp, ctx.device)
    if d.shard:
        resolve(d.shard, "distributed.shard")(model, mesh)
        if not any(_is_fsdp(m) for m in model.modules()):
            raise UserError(
                f"distributed.shard={d.shard} sharded nothing: it must call "
                f"torch.distributed.fsdp.fully_shard(module, mesh=mesh) on the model's blocks"
            )
    else:
        chosen = blocks(model, d.shard_min_params)
        for block in chosen:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        if ctx.is_main:
            print(
                f"{d.strategy}: {len(chosen)} blocks sharded on their own ({_names(model, chosen)}), then the root",
                flush=True,
            )
    if not _is_fsdp(model):
        fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def blocks(model: torch.nn.Module, min_params: int) -> list[torch.nn.Module]:
    """The model's declared blocks, else its children (containers opened) of at least `min_params`."""
    declared = set(getattr(model, "_no_split_modules", None) or ())
    if declared:
        return [m for m in model.modules() if type(m).__name__ in declared]
    found, todo = [], list(model.children())
    while todo:
        m = todo.pop(0)
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)):
            todo = list(m.children()) + todo
        elif sum(p.numel() for p in m.parameters()) >= min_params:
            found.append(m)
    return found


def _names(model, chosen) -> str:
    names = [n for n, m in model.named_modules() if any(m is c for c in chosen)]
    return ", ".join(names[:4]) + (f", ... {len(names) - 4} more" if len(names) > 4 else "") if names else "none"


def precision(amp: str, device: torch.device):
    """training.amp on CUDA: parameters in bf16/fp16 for compute, gradients reduced in fp32 (a MixedPrecisionPolicy)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy  # FSDP: only for sharded runs (see _is_fsdp)

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
    if dtype is None or device.type != "cuda":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def is_sharded(model: torch.nn.Module) -> bool:
    # Not its parameters' type: after a forward pass FSDP2 leaves the root's parameters gathered, plain tensors.
    return any(_is_fsdp(m) for m in model.modules())


def full_state(model: torch.nn.Module) -> dict:
    """Every parameter whole, on the CPU (a collective when sharded; ranks other than 0 get {})."""
    if not is_sharded(model):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # sharded: see _is_fsdp

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full(model: torch.nn.Module, state: dict) -> None:
    """Whole weights into the model, each rank keeping its shard."""
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict  # see _is_fsdp

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
    else:
        model.load_state_dict(state)


class Replicated:
    """distributed.strategy=ddp, the plain default: every process holds the whole model and optimizer, a snapshot
    writes them once (rank 0's), and the gradients are all-reduced on a step's last micro-batch only (no_sync)."""

    background = False  # a snapshot of whole state is written before training goes on

    def register(self, parts, model: torch.nn.Module, optimizer) -> None:
        parts.add("model", model)
        parts.add("optimizer", optimizer)

    def micro_step(self, model: torch.nn.Module, last: bool):
        """The context of one micro-step: DDP reduces the gradients on the last only."""
        inner = uncompiled(model)
        return inner.no_sync() if not last and isinstance(inner, DistributedDataParallel) else contextlib.nullcontext()


class Sharded(Replicated):
    """distributed.strategy=fsdp | hsdp: each process's shards, written by torch.distributed.checkpoint (in the
    background with checkpoint.async_save); gradients reduce-scattered on a step's last micro-batch only."""

    def __init__(self, background: bool) -> None:
        self.background = background

    def register(self, parts, model: torch.nn.Module, optimizer) -> None:
        from torch.distributed.checkpoint import state_dict as dcp  # sharded runs only: see _is_fsdp

        model_state = part(lambda: dcp.get_model_state_dict(model), lambda s: dcp.set_model_state_dict(model, s))
        parts.add("model", model_state, SHARDED)
        optimizer_state = part(
            lambda: dcp.get_optimizer_state_dict(model, optimizer),
            lambda s: dcp.set_optimizer_state_dict(model, optimizer, s),
        )
        parts.add("optimizer", optimizer_state, SHARDED)

    def micro_step(self, model: torch.nn.Module, last: bool):
        inner = uncompiled(model)
        if _is_fsdp(inner):
            inner.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        return super().micro_step(model, last)  # one process: the model is not sharded


def strategy(cfg) -> Replicated:
    """The sharding strategy distributed.strategy names, as the Trainer is handed it."""
    return Replicated() if cfg.distributed.strategy == "ddp" else Sharded(cfg.checkpoint.async_save)


def state_bytes(model: torch.nn.Module, optimizer) -> dict:
    """This rank's bytes of parameters, of their gradients (one per trainable parameter) and of optimizer state."""
    tensor = sys.modules.get("torch.distributed.tensor")  # imported by every sharded run (see _is_fsdp)

    def local(t):
        t = t.to_local() if tensor is not None and isinstance(t, tensor.DTensor) else t
        return t.nbytes if isinstance(t, torch.Tensor) else 0

    return {
        "parameters": sum(local(p) for p in model.parameters()),
        "gradients": sum(local(p) for p in model.parameters() if p.requires_grad),
        "optimizer": sum(local(v) for state in optimizer.state.values() for v in state.values()),
    }


def fsdp_units(model: torch.nn.Module, min_params: int) -> list[dict]:
    """Bytes of the parameters FSDP gathers as one, root first then its blocks in registration order (about
    forward order): as the run sharded the model, or as distributed.strategy=fsdp would (for `ddplab forecast`)."""
    units: list = [m for m in model.modules() if _is_fsdp(m)]
    units = units or [model, *blocks(model, min_params)]
    seen: set[int] = set()
    out = []
    for unit in reversed(units):  # innermost first: a parameter belongs to the innermost unit holding it
        own = [p for p in unit.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        out.append({"bytes": sum(p.nbytes for p in own), "params": len(own)})
    return [u for u in out[::-1] if u["params"]]
