"""The Python API with a callback of your own. Run it as any of:

    python examples/api_callback.py
    torchrun --standalone --nproc-per-node=2 examples/api_callback.py
    srun python examples/api_callback.py

The callback keeps the learning rate and loss at every log interval and, on rank 0, writes
them to lr_trace.csv in the run folder at the end.
"""

import csv
import os
import sys

import ddplab
from regression_tabular import data, model  # the regression workload beside this file


class LrTrace(ddplab.Callback):
    def __init__(self):
        self.rows = []

    def on_log(self, view, values):  # view: a read-only ddplab TrainView of the run
        self.rows.append({"step": view.step, **values})

    def on_train_end(self, view, summary):
        if view.is_main:
            with open(view.run.path / "lr_trace.csv", "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=["step", "loss", "lr"])
                writer.writeheader()
                writer.writerows(self.rows)


if __name__ == "__main__":
    overrides = ["experiment.name=api-callback", "training.epochs=5", "training.batch_size=16",
                 "training.warmup_steps=5", "logging.log_every=5", *sys.argv[1:]]
    summary = ddplab.train(overrides=overrides, model=model, data=data, callbacks=[LrTrace()])
    if os.environ.get("RANK", "0") == "0":
        print(f"status {summary['status']}, val r2 {summary['epochs'][-1]['val_r2']:.3f}")
    sys.exit(ddplab.ExitCode.PREEMPTED if summary["status"] == "preempted" else ddplab.ExitCode.OK)
