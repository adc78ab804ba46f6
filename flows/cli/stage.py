"""`rollflow replay --stage ...`: stage replay with expected values (flows/stage_replay.py), its mismatch table
and exit code (0: every value matches, 1: a mismatch). The root app's `replay` command calls `run`."""

from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table

from rollflow.flows.cli.common import console, ensure_prefect_api, fail, notice, quiet_prefect_console
from rollflow.flows.stage_replay import StageReplayFailed, parse_stages, report_of, stage_replay
from rollflow.tasks.debug.stage_replay import StageReplayReport

TABLE_ROWS = 40


def mismatch_table(report: StageReplayReport, limit: int = TABLE_ROWS) -> Table:
    shown = report.mismatches[:limit]
    table = Table(
        title=f"stage replay mismatches of run {report.source_run!r} (first {len(shown)} of {len(report.mismatches)})"
    )
    for name in ("stage", "rollout", "field", "where", "recorded", "replayed", "|diff|"):
        table.add_column(name)
    fmt = lambda v: "-" if v is None else f"{v:.8g}"  # noqa: E731
    for m in shown:
        table.add_row(m.stage, str(m.rollout_id), m.field, m.where, fmt(m.recorded), fmt(m.replayed), fmt(m.abs_diff))
    return table


def run(cfg, stage: str, rollout_ids: Optional[list[int]], source_run: Optional[str]) -> None:
    try:
        stages = parse_stages(stage)
    except ValueError as exc:
        fail(str(exc))
    for text in cfg.notices:
        notice(text)
    quiet_prefect_console()
    ensure_prefect_api()
    state = stage_replay(cfg, stages, rollout_ids=rollout_ids, source_run=source_run, return_state=True)
    value = state.result(raise_on_failure=False)
    out = report_of(value)
    if out is None:
        raise value if isinstance(value, BaseException) else RuntimeError(f"stage_replay ended {state.type.value}")
    report = StageReplayReport.from_dict(out)
    if report.mismatches:
        console.print(mismatch_table(report))
    console.print(report.summary())
    if isinstance(value, StageReplayFailed) or not report.ok:
        raise typer.Exit(1)
