"""The mismatch trend check (docs/checks.md): the slope of `train/train_rollout_logprob_abs_diff` over the
last iterations. A mismatch that sits at a level is the engine's numerics; one that climbs step after step
(vime#64: 30 steps of creep before the run diverged) is a drift the per-iteration bounds never see.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

MISMATCH_KEY = "train/train_rollout_logprob_abs_diff"
# The engine and the trainer scoring the same tokens with the same weights right after a sync: an async run's
# mismatch, since its train/rollout figure also holds how far the policy moved since the rollout's weights.
PROBE_KEY = "sync/probe_logprob_diff"
TrendVerdict = Literal["ok", "warn", "fail", "short"]


def least_squares_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The ordinary least-squares slope of ys on xs (per unit of x)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"a slope needs two or more points of equal count (got {len(xs)} x, {len(ys)} y)")
    mx, my = math.fsum(xs) / len(xs), math.fsum(ys) / len(ys)
    sxx = math.fsum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a slope needs at least two distinct x values")
    return math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


@dataclasses.dataclass(frozen=True)
class TrendReport:
    verdict: TrendVerdict
    slope: float  # per iteration; NaN when the window is not full yet
    window: int
    first_iteration: int
    last_iteration: int
    first_value: float
    last_value: float
    warn_slope: float
    fail_slope: float
    metric: str = MISMATCH_KEY

    def summary(self) -> str:
        if self.verdict == "short":
            return f"mismatch trend: {self.window} iterations needed, fewer recorded so far"
        return (
            f"mismatch trend {self.verdict}: {self.metric} slope {self.slope:.3g}/iteration over iterations "
            f"{self.first_iteration}-{self.last_iteration} ({self.first_value:.3g} -> {self.last_value:.3g}); "
            f"warn above {self.warn_slope:g}, fail above {self.fail_slope:g}"
        )


def mismatch_trend(
    points: Sequence[tuple[int, float]],
    *,
    window: int,
    warn_slope: float,
    fail_slope: float,
    metric: str = MISMATCH_KEY,
) -> TrendReport:
    """The trend of the last `window` (iteration, mismatch) points; iterations without the metric are left out
    by the caller. A non-finite mismatch in the window fails: the trainer and the engine no longer agree at all."""
    last = sorted(points)[-window:] if window > 0 else []
    if window < 3 or len(last) < window:
        return TrendReport("short", math.nan, window, 0, 0, math.nan, math.nan, warn_slope, fail_slope, metric)
    xs, ys = [float(i) for i, _ in last], [v for _, v in last]
    slope = least_squares_slope(xs, ys) if all(math.isfinite(v) for v in ys) else math.inf
    verdict: TrendVerdict = "fail" if not slope <= fail_slope else "warn" if slope > warn_slope else "ok"
    return TrendReport(verdict, slope, window, last[0][0], last[-1][0], ys[0], ys[-1], warn_slope, fail_slope, metric)


def mismatch_points(rows: Sequence[dict], metric: str = MISMATCH_KEY) -> list[tuple[int, float]]:
    """(iteration, mismatch) of the metrics.jsonl rows that have it (rows are the one metric-map exception of
    docs/architecture.md section 6.5: read here, at the edge)."""
    return [(int(r["iteration"]), float(r[metric])) for r in rows if metric in r]
