"""A training job's commands: `ddplab train` (its launcher, or one of its processes), `verify` and `status`."""

from __future__ import annotations

import functools
import itertools
import os
import time
from pathlib import Path

from ddplab.commands import at_least, split_args
from ddplab.commands.launch import check_processes, quick_exit, run_workers, under_agent
from ddplab.config import keep_global_batch
from ddplab.config.reading import format_duration
from ddplab.engine.diagnosis.phases import note_launch
from ddplab.engine.parallel.world import NodeLaunch, detect_nodes
from ddplab.engine.run_folder.folder import RunFiles, RunFolder
from ddplab.engine.run_folder.lock import claim, held, resolve_run_dir
from ddplab.engine.snapshots.fingerprint import check_resume
from ddplab.engine.snapshots.manifest import Damaged, newest, read
from ddplab.errors import STATUS_CODES, ExitCode, RunError, UserError
from ddplab.registry import check_files, checked_without_torch, load_config, workload
from ddplab.runtime.process_state import die_with_parent


def train(ns) -> int:
    at_least("--nproc-per-node", ns.nproc_per_node)
    at_least("--max-restarts", ns.max_restarts, 0)
    at_least("--replica-groups", ns.replica_groups)
    check_processes(ns.nproc_per_node or 1, ns.replica_groups or 0)  # before the config is read or a folder made
    config, overrides = split_args(ns.args)
    if ns.replica_groups:  # its groups are numbered here (run_workers), whatever the environment says of others
        overrides += [f"distributed.replica_groups={ns.replica_groups}", "distributed.replica_group=0"]
    nodes = None if "RANK" in os.environ else detect_nodes()  # before the config: a bad variable is bad input too
    cfg = load_config(config, overrides, lighthouse_started=bool(ns.replica_groups))
    check_files(cfg)
    if nodes is not None and (nodes.nnodes > 1 or not nodes.nproc_per_node.isdigit()):
        return launch_node(nodes, ns)
    if nodes is not None:  # one node: as --nproc-per-node (the number its launcher gave, unless given here)
        ns.nproc_per_node = ns.nproc_per_node or int(nodes.nproc_per_node)
        print(f"ddplab: {nodes.describe()}", flush=True)
    if ns.nproc_per_node or ns.max_restarts or ns.replica_groups:
        return launch(cfg, ns)
    if under_agent():
        die_with_parent()  # a worker never outlives its torchrun agent
    # A worker, or a plain process: only now is torch imported (the launcher never needs it).
    from torch.distributed.elastic.multiprocessing.errors import record

    from ddplab.commands.run import train

    # record(): under torchrun, the failing rank's exception shows in the launcher's failure summary.
    summary = record(train)(cfg)  # None: train() exited with SystemExit(0)
    if summary is not None and summary["status"] != "complete":
        return STATUS_CODES[summary["status"]]  # preempted: 75, interrupted (Ctrl-C): 130
    if under_agent() or ns.program:
        quick_exit(ExitCode.OK)  # the run is recorded and its files closed: no interpreter teardown to wait for
    return ExitCode.OK


def launch(cfg, ns) -> int:
    """Start the job's workers; the launcher owns the run folder for the whole job, restarts included. With
    `--replica-groups N`, each group has its own run folder (Config.run_name), which its rank 0 holds."""
    workers = functools.partial(run_workers, ns.nproc_per_node or 1, ["train", *ns.args], max_restarts=ns.max_restarts)
    if ns.replica_groups:
        if cfg.distributed.fault_tolerance != "replicas":
            raise UserError("--replica-groups runs replica groups: set distributed.fault_tolerance=replicas")
        note_launch()
        return workers(groups=ns.replica_groups)
    lock, (run_dir, note, error) = claim(cfg, resolve_run_dir(cfg), check_resume)
    if error:
        raise UserError(error)
    assert lock is not None  # claim() locks the folder unless it reports an error (no launcher folder here)
    try:
        if not checked_without_torch(cfg):
            preflight(cfg, run_dir)
        check_global_batch(cfg, run_dir, ns.nproc_per_node or 1)
        if note:
            print(note, flush=True)
        note_launch()  # the workers' start-up breakdown begins at this process's start
        return workers(env=lock.worker_env())
    finally:
        lock.release()


def launch_node(nodes: NodeLaunch, ns) -> int:
    """This node's processes of a job whose launcher (Kubeflow Trainer, SkyPilot) started one `ddplab train` per
    node: torchrun's static rendezvous at the master; the job's rank 0 holds the run folder."""
    if ns.replica_groups:
        raise UserError(f"--replica-groups runs on one machine; this is node {nodes.node_rank} of {nodes.nnodes}")
    print(f"ddplab: {nodes.describe()}", flush=True)
    return run_workers(
        ns.nproc_per_node or nodes.nproc_per_node,
        ["train", *ns.args],
        max_restarts=ns.max_restarts,
        nnodes=nodes.nnodes,
        node_rank=nodes.node_rank,
        rdzv_endpoint=f"{nodes.master_addr}:{nodes.master_port}",
    )


def check_global_batch(cfg, run_dir: Path, world_size: int) -> None:
    """A resume at another world size keeps the run's global batch; where no accumulation can, one line says so
    before any worker starts (a marker that is not a manifest is left to the workers)."""
    if cfg.checkpoint.resume == "never":
        return
    if cfg.checkpoint.resume == "auto":
        info = newest(run_dir / RunFolder.CHECKPOINTS)
    else:
        try:
            info = read(Path(cfg.checkpoint.resume))
        except Damaged:
            return
    if info and isinstance(info.get("global_batch"), int):
        keep_global_batch(info["global_batch"], cfg.training.batch_size, world_size)


def preflight(cfg, run_dir: Path) -> None:
    """For a workload without torch-free checks: build its data and model once on the CPU, so that bad code
    fails in one line before any worker starts."""
    # The launcher imports torch (and the engine's builders, which import it) only for such a workload.
    import torch

    from ddplab.engine.diagnosis import failure
    from ddplab.engine.loop.rng import seed_everything
    from ddplab.engine.loop.setup import build_data, build_model
    from ddplab.engine.parallel.distributed import DistContext, LaunchInfo

    seed_everything(cfg.experiment.seed)
    ctx = DistContext(LaunchInfo("none"), None, torch.device("cpu"))
    work = workload(cfg)
    try:
        build_model(cfg, ctx, work, build_data(cfg, ctx, work))
    except RunError as err:
        failure.record(run_dir, 0, err, str(err))
        raise


def verify(ns) -> int:
    """N-process DDP against one process with N x the batch (ddplab.commands.verify)."""
    at_least("--nproc", ns.nproc)
    at_least("--tolerance", ns.tolerance, 0)
    at_least("--weight-tolerance", ns.weight_tolerance, 0)
    from ddplab.commands.verify import verify as compare  # torch: never the launcher's import

    return compare(*split_args(ns.args), ns.nproc, ns.tolerance, ns.weight_tolerance)


def status(ns) -> int:
    """For requeue scripts under plain torchrun, and for a person: a dead job says failed and why, a live one its
    step and ETA."""
    run = RunFiles(ns.run)
    if not run.exists():
        raise UserError(f"no run folder at {ns.run} (no metrics.json)")
    if (summary := run.summary()) is None:
        raise UserError(f"{run.path / RunFolder.METRICS_JSON} is not a ddplab metrics.json")
    status = summary.get("status", "unknown")
    if status in ("running", "failed") and held(run.path):
        print(f"running: {_progress(run.path)}{_quorum(run.path)}")
    elif status in ("running", "failed"):
        why = (summary.get("failure") or {}).get("summary", "").removeprefix("job failed: ")
        print(f"failed: {why or 'the job ended without a report (killed?); see train.log'}")
        status = "failed"
    else:
        print(status)
    return STATUS_CODES.get(status, ExitCode.FAILED)


def _quorum(run: Path) -> str:
    """A replica group's run: the groups in its last step's quorum, and since which step."""
    if not (rows := RunFiles(run).quorum_steps()):
        return ""
    last = rows[-1]
    *_, since = itertools.takewhile(lambda row: row["replicas"] == last["replicas"], reversed(rows))
    which = f" (groups {last['groups'].replace(' ', ', ')})" if last.get("groups") else ""
    return f"; {last['replicas']} replica group(s){which} in the quorum since step {since['step']}"


def _progress(run: Path) -> str:
    """The last step and its age, elapsed time and ETA, from rank 0's heartbeat.json."""
    if not (beat := RunFiles(run).heartbeat()):
        return "starting (no heartbeat yet)"
    now, first = time.time(), beat["ranks"].get("0", {})
    text = f"step {first.get('step')} ({format_duration(now - beat['time'] + first.get('still_s', 0))} ago)"
    if progress := beat.get("progress"):
        since = now - progress["at"]
        text += f", elapsed {format_duration(progress['elapsed_s'] + since)}"
        if progress.get("eta_s") is not None:
            text += f", ETA {format_duration(max(progress['eta_s'] - since, 0))}"
    return text
