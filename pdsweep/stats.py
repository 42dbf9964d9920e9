"""Statistics and number coercion shared by the judges (accuracy, compare) and the
readers of results files (facts): leaves, no pdsweep imports."""

from __future__ import annotations

import math
from typing import Any


def num(x: Any) -> float | None:
    """``x`` as a finite float, or None (null, NaN, inf, bool, string: not a number)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        return float(x) if math.isfinite(x) else None
    except OverflowError:  # an int beyond float range (e.g. 10**400 in a corrupt file)
        return None


def two_proportion_p(x1: int, n1: int, x2: int, n2: int) -> float:
    """One-sided p-value that proportion 1 (the PD cell, ``x1`` correct of ``n1``) is
    lower than proportion 2 (the reference, ``x2`` of ``n2``): pooled two-proportion
    z-test, ``z = (p1 - p2) / sqrt(p(1-p)(1/n1 + 1/n2))`` with ``p = (x1+x2)/(n1+n2)``,
    ``p-value = Phi(z)`` (normal lower tail). Small values mean "PD is worse".

    Edge cases: ``n1 == 0`` or ``n2 == 0`` -> 1.0 (no evidence; :func:`judge` fails a
    cell without samples on its own); pooled ``p`` of 0 or 1 (both all wrong, or both
    all correct: identical proportions, zero variance) -> 0.5, the value of ``z = 0``.
    Raises ``ValueError`` unless ``0 <= x <= n``.
    """
    for x, n in ((x1, n1), (x2, n2)):
        if n < 0 or x < 0 or x > n:
            raise ValueError(f"need 0 <= x <= n, got x={x}, n={n}")
    if n1 == 0 or n2 == 0:
        return 1.0
    pooled = (x1 + x2) / (n1 + n2)
    var = pooled * (1 - pooled) * (1 / n1 + 1 / n2)
    if var <= 0:
        return 0.5
    z = (x1 / n1 - x2 / n2) / math.sqrt(var)
    return 0.5 * math.erfc(-z / math.sqrt(2))
