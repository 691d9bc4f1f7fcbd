"""Fault-tolerant replica groups (distributed.fault_tolerance=replicas), through torchft.

The job is `distributed.replica_groups` torchrun jobs. Each step's gradients are averaged across the groups in the
quorum a torchft Lighthouse forms at the step's start. When a group dies, the all-reduce in flight fails on the
others, `should_commit` says no, and the groups left take the step again. A group that starts again joins the next
quorum and receives the live state from a healthy group over HTTP before its first step.

Each group trains on its own share of every epoch's order (rank `group * world + rank` of `world * groups`): while a
group is missing, its share is skipped, not re-read by the others.
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import torch
from torchft import Manager, ProcessGroupGloo
from torchft.manager import MANAGER_ADDR_KEY, REPLICA_ID_KEY

from ddplab.engine.parallel.fault_tolerance import LIVE, NoReplicas
from ddplab.engine.run_folder.folder import RunFolder
from ddplab.errors import LighthouseLost, RunError


def _torchrun_store() -> torch.distributed.TCPStore:
    return torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, wait_for_workers=False
    )


class Replicas(NoReplicas):
    """This process's side of the replica groups (the Trainer's fault-tolerance mode)."""

    _parts = None  # the snapshot's parts (register()): what a rejoining group receives is read from them

    def __init__(self, cfg, ctx, log: Callable[[str], None], folder: Path) -> None:
        d = cfg.distributed
        self.group, self.groups, self.ctx, self.log = d.replica_group, d.replica_groups, ctx, log
        self.follow_lr = d.replica_lr == "follow"
        self.rejoined = False  # the last quorum replaced this group's state with a peer's
        self._first = True  # this attempt has not yet joined a quorum
        # What rides along each step's all-reduce: (budget over, stop signal, seconds spent), averaged over the groups;
        # the last one's, then the flags of the steps committed since stop() was asked, and the mean time spent.
        self._carried, self._stop, self._spent = torch.zeros(3), torch.zeros(2), torch.zeros(())
        self._marks = torch.ones(self.groups)  # the last all-reduce's marks: > 0 for each group present
        self.present = self.groups  # groups in the last step's quorum
        self.members = list(range(self.groups))  # which groups: as of the last committed step whose count changed
        self._epoch: list[int] = []  # the global batch of each step committed this epoch
        self._fewest = self.groups  # the fewest groups in a committed step this epoch
        self.timeout, self.lighthouse = d.timeout, d.lighthouse
        store = self._attempt_store() if os.environ.get("MASTER_ADDR") else self._own_store()
        self.manager = self._connect(store)
        self.csv = (folder / RunFolder.REPLICAS).open("a", newline="") if ctx.is_main else None
        if self.csv is not None and self.csv.tell() == 0:
            csv.writer(self.csv).writerow(["step", "replicas", "global_batch", "committed", "time", "groups"])

    def _connect(self, store: dict) -> Manager:
        """This process's torchft manager. The other ranks first wait for group rank 0's (_await_manager):
        torchft's own wait for rank 0's address lasts 300 s where rank 0 failed, and no signal ends it."""
        timeout = datetime.timedelta(seconds=self.timeout)

        def manager() -> Manager:
            return Manager(
                pg=ProcessGroupGloo(timeout=timeout),
                min_replica_size=1,
                load_state_dict=self.load_live_state,
                state_dict=self.live_state,
                use_async_quorum=False,
                init_sync=False,
                timeout=timeout,
                quorum_timeout=timeout,
                connect_timeout=timeout,
                rank=self.ctx.rank,
                world_size=self.ctx.world_size,
                lighthouse_addr=self.lighthouse,
                replica_id=f"group{self.group}",
                **store,
            )

        if not self.ctx.is_main:
            self._await_manager()
            return manager()
        with self._lighthouse_needed("did not answer"):
            return manager()

    @contextlib.contextmanager
    def _lighthouse_needed(self, failed: str):
        """A torchft error where the Lighthouse no longer takes connections is its failure, said as such (no rank
        caused it); any other (a peer gone, whose beat names it) goes up as it came."""
        try:
            yield
        except (RuntimeError, TimeoutError) as exc:
            url = urlsplit(self.lighthouse or "")
            try:
                socket.create_connection((url.hostname, url.port or 0), timeout=min(self.timeout, 2)).close()
            except OSError as why:
                raise LighthouseLost(
                    f"the torchft Lighthouse at {self.lighthouse} (distributed.lighthouse) {failed} within "
                    f"{self.timeout:g} s (distributed.timeout) and takes no connection ({why.strerror or why}); "
                    "torchft's error is in the traceback in logs/"
                ) from exc
            raise

    def _await_manager(self) -> None:
        """Until group rank 0's manager has put its address in torchrun's store, in a loop a signal can end (the
        heartbeat's when rank 0 failed). Rank 0 gives up on the Lighthouse after distributed.timeout: twice
        that is a rank 0 that is gone."""
        store = _torchrun_store()
        deadline = time.monotonic() + 2 * self.timeout
        while not store.check([MANAGER_ADDR_KEY]):
            if time.monotonic() > deadline:
                raise RunError(f"group rank 0 started no torchft manager within {2 * self.timeout:g} s")
            time.sleep(0.1)

    def _attempt_store(self) -> dict:
        """torchrun's store, rid of the address a previous attempt's manager left in it: the store outlives a
        `--max-restarts` restart, and torchft's manager keeps its address there under a fixed key, which a rank
        of the new attempt could read before rank 0 wrote its own (and wait on a dead manager)."""
        if self.ctx.is_main:
            base = _torchrun_store()
            for key in (MANAGER_ADDR_KEY, REPLICA_ID_KEY):
                base.delete_key(key)
        self.ctx.barrier()
        return {}

    def _own_store(self) -> dict:
        """One process started without torchrun."""
        self._store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        return {"store_addr": "localhost", "store_port": self._store.port}

    def begin_step(self) -> bool:
        """An attempt's first step waits (distributed.timeout at most) for every group: groups start a few seconds
        apart, and one that began alone would train alone until the others arrive."""
        self.rejoined = False
        with self._lighthouse_needed(f"formed no quorum for step {self.manager.current_step() + 1}"):
            self.manager.start_quorum()
            deadline = time.monotonic() + self.timeout
            while self._first and self.manager.num_participants() < self.groups and time.monotonic() < deadline:
                time.sleep(0.2)
                self.manager.start_quorum()
        self._first = False
        self.present = self.manager.num_participants()
        if self.rejoined:
            self.log(f"step {self.manager.current_step() + 1}: this group rejoined from a peer's live state")
        return self.rejoined

    def register(self, parts) -> None:
        parts.add("replicas", self)
        self._parts = parts

    def live_state(self) -> dict:
        assert self._parts is not None  # registered before the first quorum
        return {name: self._parts.objects[name].state_dict() for name in LIVE}

    def load_live_state(self, state: dict) -> None:
        assert self._parts is not None
        for name in LIVE:
            self._parts.objects[name].load_state_dict(state[name])
        self.rejoined = True

    def agree(self, params, optimizer, stop: Callable[[], torch.Tensor], step: int, samples: int) -> bool:
        """Average the gradients (this process's shards of them) over the groups in the quorum; False when a group
        failed during the step. This process's stop flags and time spent ride along, and a mark of this group,
        which names the groups present. With replica_lr=follow, the lr is scaled by the share of groups present."""
        own = stop()
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
        mark = torch.zeros(self.groups, dtype=own.dtype, device=own.device)
        mark[self.group] = 1
        tensors = [*grads, *(t.to(grads[0].dtype if grads else own.dtype) for t in (own, mark))]
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self.manager.allreduce(flat).wait()
        parts = [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors, strict=True)]
        *reduced, self._carried, self._marks = parts
        for grad, mean in zip(grads, reduced, strict=True):
            grad.copy_(mean)
        committed = self.manager.should_commit()  # every group present finished its all-reduce
        if committed:
            self._stop = torch.maximum(self._stop.to(self._carried.device), self._carried[:2].float())
            self._spent = self._carried[2]
            if self.follow_lr and self.present != self.groups:
                for group in optimizer.param_groups:
                    group["lr"] *= self.present / self.groups
        self.record(step, samples * self.ctx.world_size * self.present, committed)
        if not committed:
            self.log(f"step {step}: not committed (a replica group failed during it); taken again")
        return committed

    def shares(self, world_size: int, shares: int) -> str:
        return f"{world_size} processes x {self.groups} replica groups, with every group present"

    def stop(self, own: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The flags raised by any group in the steps committed since the last call: the same in every group (its
        `own` are not: a signal reaches the groups at different moments)."""
        flags, self._stop = self._stop, torch.zeros_like(self._stop)  # a stop's code kept (preemption.py)
        return flags

    def spent(self, own: float) -> float:
        """The groups' mean time spent as of the last committed step: the same in every group, so that a budget's
        schedule gives every group the same learning rate (a host sync: at log intervals only)."""
        return float(self._spent)

    def restore_lr(self, optimizer) -> None:
        if self.follow_lr and self.present != self.groups:
            for group in optimizer.param_groups:
                group["lr"] *= self.groups / self.present

    def record(self, step: int, global_batch: int, committed: bool) -> None:
        """A step's row in replicas.csv; the log names the groups that left or came back."""
        if committed:
            self._epoch.append(global_batch)
            self._fewest = min(self._fewest, self.present)
            if self.present != len(self.members) or self.rejoined:  # read from the device only then
                now = [g for g, share in enumerate(self._marks.tolist()) if share > 0]
                left, back = sorted(set(self.members) - set(now)), sorted(set(now) - set(self.members))
                if left or back:
                    said = [f"group {g} left" for g in left] + [f"group {g} came back" for g in back]
                    self.log(
                        f"step {step}: {', '.join(said)}; {len(now)} of {self.groups} replica groups in the quorum"
                    )
                self.members = now
        if self.csv is not None:
            groups = " ".join(map(str, self.members))
            csv.writer(self.csv).writerow(
                [step, self.present, global_batch, int(committed), f"{time.time():.3f}", groups]
            )
            self.csv.flush()

    def epoch_columns(self) -> dict:
        """`replicas`: the fewest groups any of the epoch's steps had; `global_batch`: their mean."""
        row = {"replicas": self._fewest, "global_batch": sum(self._epoch) / len(self._epoch) if self._epoch else None}
        self._epoch, self._fewest = [], self.groups
        return row

    def state_dict(self) -> dict:
        return {"epoch": list(self._epoch), "fewest": self._fewest}

    def load_state_dict(self, state: dict) -> None:
        self._epoch, self._fewest = list(state["epoch"]), state["fewest"]

    def sync_step(self, step: int) -> None:
        self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})

    def close(self) -> None:
        if self.csv is not None:
            self.csv.close()
        self.manager.shutdown(wait=False)
