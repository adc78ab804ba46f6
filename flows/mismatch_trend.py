"""The mismatch trend check of every iteration (docs/checks.md, tasks/debug/trend.py): the slope of
`train/train_rollout_logprob_abs_diff` over `watchdog.trend_window` iterations. Above `trend_warn_slope` a
warning (a log line and a Prefect event an automation can fire on), above `trend_fail_slope` the task fails
(red in the UI) and the run stops after the committed iteration."""

from __future__ import annotations

import dataclasses

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event

from rollflow.flows import reporting
from rollflow.flows.config import RunConfig
from rollflow.tasks.debug.trend import MISMATCH_KEY, PROBE_KEY, TrendReport, mismatch_points, mismatch_trend

WARNING_EVENT = "rollflow.check.warning"
SLOPE_METRIC = "mismatch/logprob_diff_slope"


def trend_with(cfg: RunConfig, row: dict) -> TrendReport:
    """The trend over the recorded iterations before `row` and `row` itself (read before `row` is recorded, so its
    slope goes into the same row)."""
    wd = cfg.watchdog
    metric = trend_metric(cfg)
    history = [r for r in reporting.read_metrics(cfg) if r["iteration"] < row["iteration"]] if wd.trend_window else []
    return mismatch_trend(
        mismatch_points([*history, row], metric),
        window=wd.trend_window,
        warn_slope=wd.trend_warn_slope,
        fail_slope=wd.trend_fail_slope,
        metric=metric,
    )


def trend_metric(cfg: RunConfig) -> str:
    """What the trend follows. Synchronous runs: the train/rollout log-prob gap (same weights on both sides). Async
    runs: that gap also holds the policy's move since the rollout's weights, which grows by design while the queue
    fills (a false alarm at max_staleness >= 2), so the post-sync probe's gap (same weights) is followed instead;
    with no probe every iteration there is no such series and the check sees none (config.py says so)."""
    return PROBE_KEY if cfg.pipeline.pipelined else MISMATCH_KEY


@task(name="mismatch-trend", cache_policy=NO_CACHE)
def mismatch_trend_task(cfg: RunConfig, report: TrendReport) -> dict:
    logger = get_run_logger()
    if report.verdict == "fail":
        raise RuntimeError(report.summary())
    if report.verdict == "warn":
        logger.warning(report.summary())
        emit_event(
            event=WARNING_EVENT,
            resource={"prefect.resource.id": f"rollflow.run.{cfg.run}", "rollflow.check": "mismatch-trend"},
            payload=dataclasses.asdict(report),
        )
    else:
        logger.info(report.summary())
    return dataclasses.asdict(report)
