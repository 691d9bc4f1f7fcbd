"""Fit the measured link (and how much slower each process computes beside others) from the
multi-process runs, by least squares on the relative error of their step times."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

from ddplab.forecast.links import Link
from ddplab.forecast.model import Comm, Compute, Measured, predict_step

# Free parameters, in the order they are freed as points allow: per-message latency (ms),
# compute scale (a process's compute time beside others / alone), nanoseconds per byte. Units
# that make all three of order 1, so that the solver's finite differences suit each.
_NAMES = ("latency", "compute_scale", "bandwidth")
_DEFAULT = np.array([0.0, 1.0, 0.0])
_LOWER = np.array([0.0, 0.2, 0.0])
_UPPER = np.array([1000.0, 20.0, 1e6])


@dataclass
class Fit:
    link: Link
    compute_scale: float
    free: tuple[str, ...]
    points: list[tuple[Measured, float]]  # (run, predicted step s)
    rms_rel: float  # root mean square of the relative errors (predicted / measured - 1) at the fit
    max_rel: float


def _link(x: np.ndarray) -> Link:
    return Link(alpha=float(x[0]) / 1e3, bandwidth=1e9 / float(x[2]) if x[2] > 0 else math.inf)


def comm_of(m: Measured) -> Comm:
    return Comm(m.buckets, m.hook, 1, m.strategy, m.units)


def predict_measured(compute: Compute, m: Measured, link: Link, scale: float) -> float:
    """A measured run's step as the model sees it; the measured link joins the processes of a node and the nodes."""
    return predict_step(
        compute, comm_of(m), m.nodes, m.per_node, m.batch, link, link, m.accum, scale, m.latency_ms, m.bandwidth_mbps
    ).step_s


def fit_link(compute: Compute, multi: list[Measured]) -> Fit:
    """Least squares (on log step-time ratios) over the multi-process runs. With n runs, min(n, 3) parameters are free:
    latency first, then the compute scale, then the bandwidth; the others stay at no latency,
    scale 1, unlimited bandwidth."""
    free = min(len(multi), 3)

    def residuals(x_free):
        x = np.concatenate([x_free, _DEFAULT[free:]])
        link = _link(x)
        # log(predicted / measured): symmetric, so a repeat slowed 2x by other jobs weighs as much
        # as one sped up 2x, and the fit lands near the geometric mean of repeats.
        return np.array([math.log(predict_measured(compute, m, link, x[1]) / m.step_s) for m in multi])

    # The model has kinks (max of compute and communication), so start from a few places: latency,
    # scale, and nanoseconds per byte unlimited or 800 Mbit/s.
    starts = itertools.product((0.0, 0.1, 1.0, 10.0), (1.0, 1.5), (0.0, 10.0))
    bounds = (_LOWER[:free], _UPPER[:free])
    fits = (least_squares(residuals, np.array(x0)[:free], bounds=bounds, method="trf") for x0 in starts)
    best = min(fits, key=lambda result: result.cost)
    x = np.concatenate([best.x, _DEFAULT[free:]])
    link = _link(x)
    points = [(m, predict_measured(compute, m, link, x[1])) for m in multi]
    rel = np.array([predicted / m.step_s - 1 for m, predicted in points])
    return Fit(link, float(x[1]), _NAMES[:free], points, float(np.sqrt(np.mean(rel**2))), float(np.max(np.abs(rel))))
