"""How large a measured change is against a run's own noise: confidence intervals from independent
windows of each run's steps (the tables' ΔMFU ± and the figures' error bars).

A run's steps after the first few (metrics.summarize skips them too) are cut into WINDOWS contiguous
windows; each window's median MFU is one sample of the run. The samples' mean has a standard error;
a change between two runs is the difference of their MFUs (the medians over all steps, the table's
MFU column), and its 95% interval is Welch's, from the two runs' window samples:

    half = t(0.975, df) * sqrt(se_a^2 + se_b^2),  df from the Welch-Satterthwaite formula

Windows of one run share that run's placement, caches and compile, so they measure how steady a
run is, not how much two launches of one config differ; a demo that repeats each job (more
minutes) would see that too. A change whose interval holds zero is marked as inside its noise.
"""
from __future__ import annotations

import math
import statistics
from typing import List, Optional, Sequence, Tuple

WARMUP_STEPS = 3   # skipped, as metrics.summarize skips them: the first steps pay for allocation
WINDOWS = 5        # samples per run
MIN_PER_WINDOW = 3

# Student's t, two-sided 95% (0.975 quantile), df 1..30; 1.96 beyond (within 2% from 30 on).
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)


def t95(df: float) -> float:
    """The 0.975 quantile of Student's t at df degrees of freedom (rounded down: the wider interval)."""
    if df < 1:
        return math.inf
    return _T95[int(df) - 1] if df < len(_T95) + 1 else 1.96


def window_samples(values: Sequence[float], windows: int = WINDOWS) -> Optional[List[float]]:
    """Each window's median of the values after the warm-up steps; None when there are too few
    steps for `windows` windows of MIN_PER_WINDOW."""
    kept = list(values[WARMUP_STEPS:])
    if len(kept) < windows * MIN_PER_WINDOW:
        return None
    size = len(kept) / windows
    return [statistics.median(kept[round(k * size):round((k + 1) * size)]) for k in range(windows)]


def mean_and_se(samples: Sequence[float]) -> Tuple[float, float]:
    return statistics.fmean(samples), statistics.stdev(samples) / math.sqrt(len(samples))


def half_width(samples: Sequence[float]) -> float:
    """95% interval half-width of one run's value."""
    return t95(len(samples) - 1) * mean_and_se(samples)[1]


def difference_half_width(a: Sequence[float], b: Sequence[float]) -> float:
    """95% interval half-width of (b - a), Welch's: the runs' spreads may differ."""
    (_, se_a), (_, se_b) = mean_and_se(a), mean_and_se(b)
    var = se_a ** 2 + se_b ** 2
    if var == 0:
        return 0.0
    df = var ** 2 / (se_a ** 4 / (len(a) - 1) + se_b ** 4 / (len(b) - 1))
    return t95(df) * math.sqrt(var)
