"""Stragglers: a rank slower than the others, log interval after log interval.

In DDP the fast ranks wait for the slowest in the gradient all-reduce, so a rank's own pace is compute plus
data wait. Each log interval gathers every rank's (compute, data wait, communication wait); a rank above the
others' median by more than logging.straggler_threshold STREAK intervals in a row is named in train.log.
Each epoch row gains the slowest rank and the spread ((slowest - fastest) / median).
"""

from __future__ import annotations

import socket
import statistics
import time

import torch

from ddplab.callbacks import Callback

STREAK = 3  # log intervals in a row: one slow interval (a page fault, a GC pause) is not a straggler


class Stragglers(Callback):
    def on_train_start(self, view):
        self.hosts = view.dist.gather_objects(socket.gethostname()) if view.world_size > 1 else []
        self.streak = [0] * view.world_size
        self.named: set[int] = set()
        self._reset(view)

    def _reset(self, view) -> None:
        self.clock, self.data, self.comm = time.perf_counter(), view.data_wait, self._comm(view)
        self.epoch = torch.zeros(view.world_size, 3, dtype=torch.float64)

    @staticmethod
    def _comm(view) -> float:
        return view.comm.comm_s if view.comm is not None else 0.0

    def on_log(self, view, values):
        if view.world_size == 1:
            return
        now, data, comm = time.perf_counter(), view.data_wait, self._comm(view)
        wall = now - self.clock
        # The epoch's counters start again from zero: then all of the current value is new.
        data_d = data - self.data if data >= self.data else data
        comm_d = comm - self.comm if comm >= self.comm else comm
        self.clock, self.data, self.comm = now, data, comm
        mine = torch.tensor([max(wall - data_d - comm_d, 0.0), data_d, comm_d], dtype=torch.float64, device=view.device)
        every = view.dist.all_gather(mine).cpu()  # (ranks, [compute, data wait, comm wait])
        self.epoch += every
        own = (every[:, 0] + every[:, 1]).tolist()
        threshold = view.config.logging.straggler_threshold
        for rank, t in enumerate(own):
            # The others' median: with two ranks, a median that included the slow one would halve its lead.
            median = statistics.median(own[:rank] + own[rank + 1 :])
            if median <= 0:
                continue
            self.streak[rank] = self.streak[rank] + 1 if t > median * (1 + threshold) else 0
            if self.streak[rank] >= STREAK and rank not in self.named:
                self.named.add(rank)
                compute, data = every[rank, :2].tolist()
                others = torch.cat([every[:rank], every[rank + 1 :]])
                loses = (
                    "data loading"
                    if data - statistics.median(others[:, 1].tolist())
                    > compute - statistics.median(others[:, 0].tolist())
                    else "compute"
                )
                view.run.log(
                    f"straggler: rank {rank} (host {self.hosts[rank]}) is {t / median - 1:.0%} slower than the "
                    f"others' median ({t / median:.2f}x their step time; logging.straggler_threshold "
                    f"{threshold:g}) {STREAK} log intervals in a row; it loses the time in {loses}"
                )

    def on_epoch_end(self, view, row):
        if view.world_size > 1 and self.epoch.sum() > 0:
            own = (self.epoch[:, 0] + self.epoch[:, 1]).tolist()
            median = statistics.median(own)
            row["slowest_rank"] = max(range(len(own)), key=own.__getitem__)
            row["rank_spread"] = (max(own) - min(own)) / median if median else None
        self._reset(view)
