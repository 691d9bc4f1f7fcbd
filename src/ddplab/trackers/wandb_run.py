"""Weights & Biases: one run per run folder, its id kept in trackers.json."""

from __future__ import annotations

import os
import uuid

from ddplab.runtime import process_state
from ddplab.trackers.base import Tracker


class WandB(Tracker):
    """One W&B run per run folder, its id in trackers.json. W&B's files (with WANDB_MODE=offline, the whole run)
    go into the run folder's wandb/, or under $WANDB_DIR when the user set it."""

    name = "wandb"
    remembers = True  # an offline run cannot be asked what it holds

    def start(self, view, record, study):
        import wandb  # the track extra; seconds to import, only when wandb is a tracker

        # A parent's W&B service (WANDB_SERVICE: "<version>-<its pid>-...") would outlive this process if killed,
        # holding the run ("run ID ... is in use") from the next attempt: this process starts its own.
        if (service := os.environ.get("WANDB_SERVICE")) and service.split("-")[1:2] != [str(os.getpid())]:
            process_state.env_unset("WANDB_SERVICE", "a parent's W&B service would outlive a killed run")
        cfg, mine = view.config, record.get(self.name, {})
        run_id = mine.get("id") or uuid.uuid4().hex[:12]
        config = {**cfg.to_dict(), **({"study_point": study} if study else {})}
        self.run = wandb.init(
            project=cfg.logging.wandb_project,
            name=cfg.run_name(),
            id=run_id,
            resume="allow",
            # Named each time, the user's first: wandb.setup() keeps the WANDB_DIR it first read for the process.
            dir=os.environ.get("WANDB_DIR") or str(view.run.path),
            group=study["study"] if study else None,
            config=None if "id" in mine else config,
            settings=wandb.Settings(console="off"),
        )
        train, epoch = mine.get("train", 0), mine.get("epoch", 0)
        record[self.name] = {"id": run_id, "project": cfg.logging.wandb_project, "train": train, "epoch": epoch}
        # Online, a resumed run knows its last step; offline, trackers.json does.
        held = max(self.run.starting_step - 1, 0) if self.run.resumed else 0
        return max(train, held), max(epoch, held)

    def log(self, values, step):
        self.run.log(values, step=step)

    def finish(self, view, status):
        if status == "preempted":
            self.run.mark_preempting()
        self.run.finish(exit_code=1 if status == "failed" else 0)
