"""When a run stops, agreed by every rank after a step: max_steps, the time budget, a stop signal (SIGTERM,
SIGUSR1, SIGINT) or a callback's view.request_stop. All ranks stop at the same step, or one would wait forever in a
collective for another; they ask where they meet anyway (the log interval), never every step."""

from __future__ import annotations

import torch

from ddplab.config.reading import parse_duration
from ddplab.engine.loop.preemption import STOPS, StopSignals


class Stops:
    def __init__(self, t, log_every: int, ctx, state, log, faults) -> None:
        """`t`: the training section; `log_every`: logging.log_every, the steps between the ranks' meetings."""
        self.t, self.log_every, self.ctx, self.state, self.log, self.faults = t, log_every, ctx, state, log, faults
        self.budget = parse_duration(t.time_budget, "training.time_budget")
        self.signals = StopSignals()
        self.request: str | None = None  # a callback's view.request_stop on this rank, not yet agreed

    def own(self) -> torch.Tensor:
        """This process's own reasons to stop (the time budget is over, a stop signal came), then its time spent."""
        spent = self.state.elapsed
        over = self.budget is not None and spent >= self.budget
        return torch.tensor([float(over), float(self.signals.code), spent], device=self.ctx.device)

    def agree_on_request(self) -> None:
        """Some rank's callback asked to stop (it rode along the log interval's reduction): every rank takes the
        lowest asking rank's reason (one gather, once in a run)."""
        reasons = self.ctx.gather_objects(self.request)
        rank, reason = next((r, why) for r, why in enumerate(reasons) if why is not None)
        self.state.stop_reason = reason
        self.log(f"stop requested ({reason}, by a callback on rank {rank}) after step {self.state.step}")

    def after_step(self) -> bool:
        """Whether to stop after this step, the same on every rank."""
        s, t = self.state, self.t
        if s.stop_reason is not None:  # a request, agreed at this step's log interval or snapshot
            return True
        if t.max_steps and s.step >= t.max_steps:
            s.stop_reason = "max_steps"  # the same on every rank without asking
            return True
        if s.step % self.log_every:
            # Asking every step would put a collective and a host sync in every step; the
            # log interval is a schedule all ranks share, and where the loop syncs anyway.
            return False
        flags = self.faults.stop(self.own)  # replica groups: raised in any group
        over, signalled = self.ctx.all_reduce(flags.to(self.ctx.device), "max").tolist()
        if signalled:
            s.stop_reason = STOPS[int(signalled) - 1]  # a Ctrl-C on any rank makes the job's stop one
            self.log(
                f"stop signal ({self.signals.received or 'on another rank'}) after step {s.step}: "
                f"snapshotting and exiting"
            )
        elif over:
            s.stop_reason = "time_budget"
            self.log(f"time budget {t.time_budget} reached after step {s.step} ({s.elapsed:.1f} s spent)")
        return s.stop_reason is not None
