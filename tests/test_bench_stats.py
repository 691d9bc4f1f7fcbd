"""The statistics benchmarks/overhead.py decides with: ratios of paired runs and their interval."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import paired_ratio, resolved  # noqa: E402


def test_pairs_are_compared_run_by_run_so_a_drift_that_hits_both_cancels():
    # The machine slows down 2x between the pairs; each pair is level, so the ratio is exactly 1.
    ratio, lo, hi = paired_ratio([1.0, 2.0, 4.0], [1.0, 2.0, 4.0])
    assert (ratio, lo, hi) == (1.0, 1.0, 1.0)
    ratio, lo, hi = paired_ratio([0.9, 1.8, 3.6], [1.0, 2.0, 4.0])
    assert ratio == pytest.approx(0.9) and lo == pytest.approx(0.9) and hi == pytest.approx(0.9)


def test_interval_is_student_t_on_the_mean_log_ratio():
    a, b = [math.exp(0.1), math.exp(-0.1)], [1.0, 1.0]
    ratio, lo, hi = paired_ratio(a, b)
    half = 12.7062 * math.sqrt(0.02) / math.sqrt(2)  # t(0.975, df=1) * sd / sqrt(n), sd of (0.1, -0.1)
    assert ratio == pytest.approx(1.0)
    assert lo == pytest.approx(math.exp(-half), rel=1e-4) and hi == pytest.approx(math.exp(half), rel=1e-4)


def test_one_pair_has_no_interval():
    ratio, lo, hi = paired_ratio([2.0], [1.0])
    assert ratio == 2.0 and lo == 0.0 and hi == math.inf


def test_resolved_needs_both_ends_within_the_fraction():
    assert resolved(1.0, 0.96, 1.04, 0.05)
    assert not resolved(1.0, 0.96, 1.06, 0.05)
    assert not resolved(1.0, 0.94, 1.04, 0.05)
    assert not resolved(2.0, 0.0, math.inf, 0.05)
