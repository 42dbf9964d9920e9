"""An expected accuracy score's tolerance at the run's sample size.

``accuracy/expected.yaml`` gives each score a ``tolerance`` calibrated at ``n`` samples (upstream
``tests/v1/kv_connector/nixl_integration/test_accuracy.py``: RTOL 0.05 on the whole gsm8k test
set, 1319 questions; pdsweep's tiny models: their ``sweeps/cpu-expected.yaml`` run). A run that
scores fewer (``eval.limit``) has more sampling noise: the binomial standard error of a score
``p`` on ``n`` samples is ``sqrt(p (1 - p) / n)`` (``scipy.stats.binom(n, p).std() / n``), so the
tolerance at ``n_run < n`` widens by the extra noise, :data:`Z` standard errors of it added in
quadrature::

    tol_run = sqrt(tol**2 + (Z * se_extra)**2),   se_extra**2 = p (1 - p) (1/n_run - 1/n)

(``p`` the expected value). At ``n_run >= n`` the calibrated tolerance applies as is (never
tighter). Qwen3-0.6B's gsm8k 0.41 +/- 0.05 at n 1319 is +/- 0.098 at ``limit: 250``.
"""

from __future__ import annotations

import math
from typing import Any

from scipy import stats

Z = 3.0  # standard errors of the extra sampling noise (scripts/expected_scores.py's 3 x stderr)


def standard_error(p: float, n: int) -> float:
    """The binomial standard error of a score ``p`` (fraction) measured on ``n`` samples."""
    return float(stats.binom(n, p).std()) / n


def tolerance_at(expected: dict[str, Any], n_run: int | None) -> tuple[float, str]:
    """``(tolerance, how)`` of an expected entry (``{value, tolerance, n, ...}``) for a score on
    ``n_run`` samples (module doc); ``how`` says what was done, '' when the calibrated tolerance
    applies as is. Without ``n`` (an entry made by hand) or ``n_run`` the calibrated tolerance
    applies, and ``how`` says it was not scaled."""
    tol, n_cal, p = float(expected["tolerance"]), expected.get("n"), float(expected["value"])
    if not isinstance(n_cal, int) or not isinstance(n_run, int) or n_run <= 0:
        return tol, f"tolerance not scaled: calibration n {n_cal}, run n {n_run}"
    if n_run >= n_cal:
        return tol, ""
    extra = standard_error(p, n_run) ** 2 - standard_error(p, n_cal) ** 2
    scaled = math.sqrt(tol**2 + Z**2 * max(extra, 0.0))
    return scaled, f"tolerance {tol} at n={n_cal} scaled to n={n_run}: +/- {scaled:.3f} (binomial SE, {Z:g} SE)"
