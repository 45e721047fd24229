"""Summaries of timing samples: medians, percentiles and spread, no numpy."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["percentile", "spread"]


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation; NaN if empty."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def spread(samples: Sequence[float]) -> tuple[float, float, float]:
    """(p10, median, p90) of the samples."""
    return percentile(samples, 10), percentile(samples, 50), percentile(samples, 90)
