"""ddplab inside Ray Train: each of Ray's TorchTrainer workers calls ddplab.train(), which trains in the process
group Ray made, writes its run folder as always, and reports each complete snapshot to Ray (ray.train.report with
a Checkpoint). A worker that dies is restarted by Ray (FailureConfig), and the run continues from its last snapshot.

    pip install 'ddplab[ray]'   # from a clone: pip install '.[ray]'
    python examples/ray_train.py --workers 2 training.max_steps=200            # a local Ray on this machine
    RAY_ADDRESS=auto python examples/ray_train.py --workers 8 --gpu CONFIG.yaml  # a Ray cluster
    python examples/ray_train.py --workers 2 --kill-once 1:5 training.epochs=2  # rank 1 dies after step 5, once

Any ddplab config file and key=value overrides follow the options. On a cluster, experiment.output_dir must be a
folder every Ray node sees (a shared file system): a restarted worker group may land on other nodes.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import ddplab


class KillOnce(ddplab.Callback):
    """--kill-once RANK:STEP: that rank sends itself SIGKILL after that step, in the first attempt only (a file
    beside the run folder remembers it), to show Ray restart the worker group and ddplab resume."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_step_end(self, view) -> None:
        marker = Path(view.config.experiment.output_dir) / f".killed-{view.config.experiment.name}"
        if view.rank == self.rank and view.step == self.step and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)


def train_loop(config: dict) -> None:
    """What each Ray Train worker runs."""
    callbacks = [KillOnce(*config["kill_once"])] if config["kill_once"] else []
    ddplab.train(config["config"], config["overrides"], callbacks=callbacks)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="Ray Train workers (DDP processes)")
    p.add_argument("--gpu", action="store_true", help="one GPU per worker")
    p.add_argument("--max-failures", type=int, default=3, help="worker-group restarts Ray allows (FailureConfig)")
    p.add_argument("--storage", default="ray_results", help="where Ray keeps the checkpoints reported to it")
    p.add_argument("--kill-once", metavar="RANK:STEP", help="that rank kills itself after that step, once")
    p.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value]")
    ns = p.parse_args(argv)
    configs = [a for a in ns.args if "=" not in a]
    overrides = [a for a in ns.args if "=" in a]
    if not any(o.startswith("experiment.output_dir=") for o in overrides):  # absolute: Ray workers' folder differs
        overrides.append(f"experiment.output_dir={Path('experiments').resolve()}")
    if "RAY_ADDRESS" in os.environ:
        ray.init()
    else:  # a local Ray on loopback, one CPU per worker
        ray.init(num_cpus=ns.workers, include_dashboard=False, _node_ip_address="127.0.0.1")
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={
            "config": configs[0] if configs else None,
            "overrides": overrides,
            "kill_once": [int(x) for x in ns.kill_once.split(":")] if ns.kill_once else None,
        },
        scaling_config=ScalingConfig(num_workers=ns.workers, use_gpu=ns.gpu),
        run_config=RunConfig(
            name="ddplab",
            storage_path=str(Path(ns.storage).resolve()),
            failure_config=FailureConfig(max_failures=ns.max_failures),
        ),
    )
    result = trainer.fit()
    print(f"ray: last checkpoint {result.checkpoint.path if result.checkpoint else None}; metrics {result.metrics}")
    return 0 if result.error is None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
