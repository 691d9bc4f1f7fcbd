"""Your own optimizer, handed to the trainer through ddplab's table of builders (`Builders`): here SGD with
Nesterov momentum and no weight decay on biases, on the regression workload beside this file. Run it as any of:

    python examples/own_optimizer.py
    torchrun --standalone --nproc-per-node=2 examples/own_optimizer.py

A builder takes what ddplab's own takes (src/ddplab/engine/loop/parts.py): the optimizer gets the training section
of the config, the job (what a workload function gets: .rank, .world_size, .dist), the model as the run trains it and
the learning rate after training.lr_scaling. Its state is in every snapshot, so a resume continues it exactly.
`loaders=` and `feed=` replace the data loaders the same way.
"""

import os
import sys

import torch

import ddplab
from ddplab.engine.loop.parts import Builders
from regression_tabular import data, model  # the regression workload beside this file


def optimizer(training, job, model, lr):
    decay = [p for p in model.parameters() if p.dim() >= 2]  # weights; biases are left undecayed
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 1e-4}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=True)


def train(*overrides, callbacks=()):
    overrides = ("experiment.name=own-optimizer", "training.epochs=5", "training.batch_size=16",
                 "training.lr=0.02", "training.warmup_steps=0", *overrides)
    return ddplab.train(overrides=overrides, model=model, data=data, callbacks=callbacks,
                        builders=Builders(optimizer=optimizer))


if __name__ == "__main__":
    summary = train(*sys.argv[1:])
    if os.environ.get("RANK", "0") == "0":
        print(f"status {summary['status']}, val r2 {summary['epochs'][-1]['val_r2']:.3f}")
    sys.exit(ddplab.ExitCode.PREEMPTED if summary["status"] == "preempted" else ddplab.ExitCode.OK)
