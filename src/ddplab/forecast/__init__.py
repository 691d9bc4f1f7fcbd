"""`ddplab forecast`: predicted step and epoch time of setups and strategies (ddp, fsdp, hsdp)
that were never run, from run folders that were. See docs/forecast.md for the model and its assumptions."""

from __future__ import annotations

import argparse
import itertools
import json
import math
from dataclasses import dataclass, field

from ddplab.config import batch_arithmetic
from ddplab.config.reading import parse_duration
from ddplab.errors import UserError
from ddplab.forecast.fit import fit_link
from ddplab.forecast.links import Link, parse_bandwidth, parse_hook, parse_latency
from ddplab.forecast.model import Comm, fit_compute, measure, predict_step
from ddplab.forecast.sharded import STRATEGIES
from ddplab.report.runs import find_runs
from ddplab.study.grid import parse_setups


@dataclass
class Forecast:
    workload: str
    rows: list[dict]
    notes: list[str] = field(default_factory=list)
    fit: object | None = None
    budget_s: float | None = None


def _label(run) -> str:
    cfg = run.summary.get("config", {})
    return f"{cfg.get('model', {}).get('name', '?')} on {cfg.get('data', {}).get('name', '?')}"


def load(dirs: list[str]):
    """The runs under `dirs` as Measured points, all of one workload (model and data)."""
    runs, _ = find_runs(dirs, "forecast")
    kinds = {json.dumps([r.summary.get("config", {}).get(k) for k in ("model", "data")], sort_keys=True) for r in runs}
    if len(kinds) > 1:
        raise UserError(
            f"forecast: the runs given train {len(kinds)} different workloads "
            f"({', '.join(sorted({_label(r) for r in runs}))}); forecast one model and data set at a time"
        )
    measured = [m for m in (measure(r) for r in runs) if m is not None]
    if not measured:
        raise UserError(f"forecast: no run under {', '.join(dirs)} finished a full epoch")
    return _label(runs[0]), measured


def forecast(dirs: list[str], opts: argparse.Namespace) -> Forecast:
    """`opts`: the command's options (ddplab.cli), as typed."""
    # Check every option before reading anything.
    setups = parse_setups(opts.setups, option="--setups")
    bandwidth = parse_bandwidth(opts.bandwidth) if opts.bandwidth is not None else None
    latency = parse_latency(opts.latency) if opts.latency is not None else None
    intra_bw = parse_bandwidth(opts.intra_bandwidth, "--intra-bandwidth") if opts.intra_bandwidth is not None else None
    budget = parse_duration(opts.budget, "--budget")
    hook, rank = parse_hook(opts.comm_hook)
    asked = [s.strip() for s in opts.strategy.split(",")] if opts.strategy else []
    if any(s not in STRATEGIES for s in asked) or (opts.strategy and not asked):
        raise UserError(f"--strategy: expected ddp, fsdp or hsdp (comma-separated), got {opts.strategy!r}")
    if hook not in (None, "none") and set(asked) - {"ddp"}:
        raise UserError(
            f"--comm-hook {opts.comm_hook} is a DDP communication hook; fsdp and hsdp reduce gradients "
            f"themselves: forecast them without it"
        )

    label, measured = load(dirs)
    singles = [m for m in measured if m.processes == 1]
    multi = [m for m in measured if m.processes > 1 and m.buckets]
    compute = fit_compute(singles)
    notes = [
        f"compute from {len(singles)} 1-process run(s) "
        + (
            "(forward and backward timed by the runs)"
            if compute.timed
            else "(forward/backward not timed by these runs: backward taken as 2/3 of the model time)"
        )
    ]
    batches = sorted({m.batch for m in singles})
    notes.append(
        f"compute per step fitted as a fixed part plus a part per sample, from batch sizes "
        f"{', '.join(map(str, batches))}"
        if len(batches) > 1
        else f"compute per step taken as proportional to the batch (1-process runs at batch {batches[0]} "
        f"only); a 1-process run at a second batch size fits its fixed part too"
    )
    fit = None
    if bandwidth is None or latency is None:
        if not multi:
            raise UserError(
                "forecast: no multi-process run with recorded gradient buckets to fit the link from; "
                "give --bandwidth and --latency, or add runs with 2 or more processes"
            )
        fit = fit_link(compute, multi)
        notes.append(
            f"link FITTED from {len(multi)} multi-process run(s) ({', '.join(fit.free)} free): "
            f"{fit.link.describe()}, compute scale {fit.compute_scale:.2f}; relative residual "
            f"rms {fit.rms_rel:.1%}, worst {fit.max_rel:.1%}"
        )
    fitted = fit.link if fit else Link(0.0, math.inf)
    inter = Link(latency if latency is not None else fitted.alpha, bandwidth or fitted.bandwidth)
    intra = Link(fitted.alpha if fit else (latency or 0.0), intra_bw or (fitted.bandwidth if fit else inter.bandwidth))
    scale = fit.compute_scale if fit else 1.0
    given = [name for name, value in (("bandwidth", bandwidth), ("latency", latency)) if value is not None]
    source = "given" if len(given) == 2 else "fitted" if not given else f"{given[0]} given, the rest fitted"
    intra_source = "bandwidth given" if intra_bw else "as fitted" if fit else "as the inter-node link"
    notes += [
        f"inter-node link: {inter.describe()} ({source})",
        f"intra-node link: {intra.describe()} ({intra_source})",
    ]
    if abs(scale - 1.0) > 0.02:
        notes.append(
            f"each of several processes computes at {scale:.2f}x the 1-process time (fitted; "
            f"processes sharing this machine's cores); separate devices would be nearer 1.0"
        )

    ref = max(measured, key=lambda m: (m.processes == 1, len(m.buckets), -m.processes))
    buckets = next((m.buckets for m in multi), None) or ref.buckets
    if not buckets:
        raise UserError(
            "forecast: the runs do not record their gradient buckets (metrics.json 'comm'); "
            "re-run them with this version of ddplab"
        )
    strategies = asked or [s for s in STRATEGIES if any(m.strategy == s for m in measured)]
    units: list[dict] = next((m.units for m in measured if m.units), [])
    comm = Comm(buckets, hook or ref.hook, rank)
    batch, accum, n_train = opts.batch_size or ref.batch, ref.accum, ref.train_samples
    one = predict_step(compute, comm, 1, 1, batch, inter, intra, accum, scale)
    epoch_one = batch_arithmetic(batch, accum, 1, n_train)["steps_per_epoch"] * one.step_s
    rows = []
    for strategy, s in itertools.product(strategies, setups):
        how = comm if strategy == "ddp" else Comm(buckets, "none", 1, strategy, units)
        step = predict_step(compute, how, s.nodes, s.per_node, batch, inter, intra, accum, scale)
        counts = batch_arithmetic(batch, accum, s.processes, n_train)
        epoch = counts["steps_per_epoch"] * step.step_s
        speedup = epoch_one / epoch if epoch else None
        rows.append(
            {
                "strategy": strategy,
                "setup": s.label,
                "processes": s.processes,
                "sent_mb": step.sent_bytes / 1e6,
                "global_batch": counts["global"],
                "steps_per_epoch": counts["steps_per_epoch"],
                "step_ms": step.step_s * 1e3,
                "compute_ms": step.compute_s * 1e3,
                "comm_ms": step.comm_s * 1e3,
                "exposed_comm_ms": step.exposed_s * 1e3,
                "epoch_s": epoch,
                "comm_share": step.exposed_s / step.step_s if step.step_s else 0.0,
                "epochs_in_budget": budget / epoch if budget and epoch else None,
                "speedup": speedup,
                "efficiency": speedup / s.processes if speedup else None,
            }
        )
    grad = sum(b["bytes"] for b in buckets)
    notes.append(
        f"{n_train} training samples, {batch} per process, gradient {grad:,} bytes in {len(buckets)} "
        f"bucket(s), hook {comm.hook}" + (f" (rank {rank})" if comm.hook == "powersgd" else "")
    )
    if set(strategies) - {"ddp"}:
        source = (
            "as the runs recorded them" if units else "the gradient buckets standing in: the runs did not record them"
        )
        shown = Comm(buckets, units=units).units
        notes.append(
            f"fsdp/hsdp: {len(shown)} unit(s) gathered one by one ({source}), "
            f"{sum(u['bytes'] for u in shown):,} bytes of parameters"
        )
    return Forecast(label, rows, notes, fit, budget)
