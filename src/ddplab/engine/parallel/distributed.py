"""The one seam to torch.distributed.

Starts the process group where the launcher's environment (read by world.py: torchrun, SLURM, Kubeflow
Trainer, SkyPilot, or nothing) says, picks backend and device, wraps models in DDP, and offers rank-0 helpers
and reductions. Nothing else in ddplab calls `init_process_group`.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddplab.engine.parallel.world import LaunchInfo, detect_launch
from ddplab.errors import UserError
from ddplab.runtime import process_state


class Beat:
    """Where this rank stands, for the heartbeat thread (engine/diagnosis/heartbeat.py) to publish: set by plain
    attribute writes (no sync, no collective), so marking a phase costs next to nothing."""

    step, phase, collective, waiting, ticks = 0, "start", None, False, 0
    progress: dict | None = None  # rank 0: elapsed and ETA at the last log (metrics.callbacks), for `ddplab status`

    def mark(self, phase: str, step: int | None = None) -> None:
        self.phase, self.ticks = phase, self.ticks + 1
        if step is not None:
            self.step = step

    @contextlib.contextmanager
    def inside(self, collective: str):
        """The last collective entered, and whether this rank is still waiting in it."""
        self.collective, self.waiting, self.ticks = collective, True, self.ticks + 1
        try:
            yield
        finally:
            self.waiting, self.ticks = False, self.ticks + 1


@dataclass
class DistContext:
    """This process's view of the job, with the reductions the trainer needs."""

    launch: LaunchInfo
    backend: str | None
    device: torch.device
    beat: Beat = field(default_factory=Beat)

    rank = property(lambda self: self.launch.rank)
    world_size = property(lambda self: self.launch.world_size)
    local_rank = property(lambda self: self.launch.local_rank)
    is_main = property(lambda self: self.launch.rank == 0)
    is_distributed = property(lambda self: self.backend is not None)

    def barrier(self) -> None:
        if self.is_distributed:
            with self.beat.inside("barrier"):
                dist.barrier()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place, and returned; a no-op with one process."""
        if self.is_distributed:
            with self.beat.inside(f"all_reduce ({op})"):
                dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op.upper()))  # sum, max, min
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor`, stacked in rank order (world_size x ...)."""
        if not self.is_distributed:
            return tensor.unsqueeze(0)
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        with self.beat.inside("all_gather"):
            dist.all_gather(out, tensor)
        return torch.stack(out)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not self.is_distributed:
            return obj
        box = [obj]
        with self.beat.inside("broadcast_object"):
            dist.broadcast_object_list(box, src=src)
        return box[0]

    def broadcast_buffers(self, module: torch.nn.Module, src: int = 0) -> None:
        """Copy rank `src`'s buffers (BatchNorm running statistics) to every rank, in place."""
        if self.is_distributed:
            for buf in module.buffers():
                dist.broadcast(buf.data, src=src)

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's object, on every rank, in rank order."""
        if not self.is_distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with self.beat.inside("all_gather_object"):
            dist.all_gather_object(out, obj)
        return out


def pick_backend(requested: str, cuda: bool) -> str:
    return ("nccl" if cuda else "gloo") if requested == "auto" else requested


def check_one_gpu_per_process(processes_per_node: int, gpus: int) -> None:
    """NCCL refuses two ranks on one GPU, with an opaque 'invalid usage' at the first collective."""
    if processes_per_node > gpus:
        raise UserError(
            f"{processes_per_node} processes on this node but {gpus} GPU(s) visible: NCCL needs one GPU "
            f"per process; start at most {gpus} per node, or set distributed.backend=gloo"
        )


@contextlib.contextmanager
def session(backend: str = "auto", timeout_s: float = 600.0) -> Iterator[DistContext]:
    """Start the process group (if launched as several processes) and always tear it down; or use the one the
    launcher made itself (Ray Train's TorchTrainer), and leave it to the launcher. Teardown collects garbage
    first: with gloo, a DDP model or optimizer alive at destroy time made one two-process run in four abort."""
    launch = detect_launch()
    cuda = torch.cuda.is_available()
    chosen = pick_backend(backend, cuda) if launch.world_size > 1 else None
    made = dist.is_available() and dist.is_initialized()
    if made:
        launch, chosen = adopt(launch), dist.get_backend()
    if chosen == "nccl":
        check_one_gpu_per_process(launch.local_world_size, torch.cuda.device_count())
    device = torch.device("cuda", launch.local_rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if chosen is not None and not made:
        if launch.launcher == "slurm":
            process_state.env_default("MASTER_ADDR", launch.master_addr or "localhost")
            process_state.env_default("MASTER_PORT", str(launch.master_port))
        kwargs: dict[str, Any] = {"device_id": device} if chosen == "nccl" else {}
        if (store := attempt_store(launch, timeout_s)) is not None:
            kwargs["store"] = store
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(chosen, rank=launch.rank, world_size=launch.world_size, timeout=timeout, **kwargs)
    ok = False
    try:
        yield DistContext(launch=launch, backend=chosen, device=device)
        ok = True
    finally:
        gc.collect()
        if not made and dist.is_available() and dist.is_initialized():
            if ok:
                # Let every rank finish its last collective before the group goes away.
                with contextlib.suppress(Exception):
                    dist.barrier()
            gc.collect()
            dist.destroy_process_group()


def adopt(launch: LaunchInfo) -> LaunchInfo:
    """A process group that exists already: its maker's (Ray Train's, where ray.train is loaded), and its rank and
    size, which must agree with the environment's."""
    if launch.world_size > 1 and (launch.rank, launch.world_size) != (dist.get_rank(), dist.get_world_size()):
        raise UserError(
            f"the process group already made is rank {dist.get_rank()} of {dist.get_world_size()}, but RANK="
            f"{launch.rank} and WORLD_SIZE={launch.world_size}: they must agree"
        )
    maker = "ray" if "ray.train" in sys.modules else "external"
    return replace(launch, launcher=maker, rank=dist.get_rank(), world_size=dist.get_world_size(), via=None)


def attempt_store(launch: LaunchInfo, timeout_s: float):
    """torchrun's own store, under a prefix per restart attempt (None outside torchrun).

    The agent's store outlives a `--max-restarts` restart; without the prefix, workers of
    the new attempt can read the dead attempt's peer addresses and fail to connect."""
    if launch.launcher != "torchrun" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    assert launch.master_addr is not None and launch.master_port is not None  # torchrun sets both
    timeout = datetime.timedelta(seconds=timeout_s)
    base = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"ddplab/attempt-{attempt}", base)


def wrap_model(
    model: torch.nn.Module, ctx: DistContext, *, bucket_cap_mb: float = 25.0, find_unused_parameters: bool = False
) -> torch.nn.Module:
    """DDP around the model when there is more than one process; the model itself otherwise."""
    model.to(ctx.device)
    if not ctx.is_distributed:
        return model
    return DDP(
        model,
        device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=True,
        find_unused_parameters=find_unused_parameters,
    )
