"""`ddplab verify`: N-process DDP against one process with N x the batch (ddplab.verify)."""

from __future__ import annotations

from ddplab.commands import at_least, split_args
from ddplab.verify import verify


def main(ns) -> int:
    at_least("--nproc", ns.nproc)
    config, overrides = split_args(ns.args)
    return verify(config, overrides, ns.nproc, ns.tolerance, ns.weight_tolerance)
