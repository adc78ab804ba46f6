"""`rollflow align` and `rollflow serve`: the alignment check once, or nightly.

The root app (flows/cli/root.py) calls `register(app)`; shared helpers come from flows/cli/common.py (no import circle).
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import List, Optional

import typer

from rollflow.flows.cli.common import (
    ConfigOpt,
    SetOpt,
    build_config,
    console,
    ensure_prefect_api,
    err_console,
    notice,
    quiet_prefect_console,
    user_errors,
)
from rollflow.tasks.debug.checks import AlignmentReport


def run_align(cfg, memory_budget_mb: float | None = None, *, local: bool = False, repro: bool = False) -> dict:
    """The report dict of one alignment run (through Prefect + Ray, or in this process with `local`)."""
    # lazy: keeps torch/prefect out of CLI start-up
    from rollflow.flows.alignment import AlignmentFailed, alignment_check, write_report_json

    if local:
        from rollflow.tasks.debug.alignment import run_alignment_local  # lazy: keeps torch/prefect out of CLI start-up

        report = run_alignment_local(cfg, memory_budget_mb=memory_budget_mb)
        return report.to_dict() | {"json_path": write_report_json(cfg, report)}
    state = alignment_check(cfg, memory_budget_mb=memory_budget_mb, reproducibility=repro, return_state=True)
    if state.is_completed():
        return state.result()
    exc = state.result(raise_on_failure=False)
    if isinstance(exc, AlignmentFailed) and exc.report is not None:
        return exc.report
    raise RuntimeError(f"the alignment flow ended {state.type.value}: {exc}")


def register(app: typer.Typer) -> None:
    config_opt, set_opt = ConfigOpt, SetOpt

    @app.command("align")
    def align(
        config: Optional[str] = config_opt,
        sets: Optional[List[str]] = set_opt,
        memory_budget_mb: Optional[float] = typer.Option(
            None, "--memory-budget-mb", help="fail when a worker's peak memory (MB) exceeds this"
        ),
        as_json: bool = typer.Option(False, "--json", help="print the JSON report instead of markdown"),
        local: bool = typer.Option(False, "--local", help="run in this process: no Prefect server, no Ray"),
        repro: bool = typer.Option(
            False,
            "--repro",
            help="also the bitwise reproducibility gate and the group-diversity guard (the config run twice)",
        ),
    ) -> None:
        """Precision alignment checks on fresh workers; prints the report, exit code 1 if a check fails."""
        from rollflow.flows.preflight import preflight  # lazy: keeps torch/prefect out of CLI start-up

        cfg = build_config(config, sets)
        # Everything but the report goes to stderr, so `--json` output can be piped.
        with contextlib.redirect_stdout(sys.stderr), user_errors("align"):
            preflight(cfg, "align")  # before Prefect, Ray or any actor: one line, exit 2
            for text in cfg.notices:
                notice(text)
            if not local:
                quiet_prefect_console()
                api = ensure_prefect_api()
                err_console.print(
                    f"alignment check of run [bold]{cfg.run}[/] (actors {cfg.run}-align); Prefect UI "
                    f"at {api.removesuffix('/api')}"
                )
            if repro and local:
                raise typer.BadParameter("--repro runs the config twice through Prefect and Ray: drop --local")
            out = run_align(cfg, memory_budget_mb, local=local, repro=repro)
        report = AlignmentReport.from_dict(out)
        if as_json:
            typer.echo(json.dumps(out, indent=2))
        else:
            typer.echo(report.to_markdown())
            typer.echo(f"JSON report: {out.get('json_path')}")
        raise typer.Exit(1 if report.failed else 0)

    @app.command("serve")
    def serve(
        cron: str = typer.Option("0 2 * * *", help="cron schedule (UTC) of the nightly alignment run"),
        register_only: bool = typer.Option(
            False, "--register-only", help="register the deployment and its schedule, then exit"
        ),
        config: Optional[str] = config_opt,
        sets: Optional[List[str]] = set_opt,
        memory_budget_mb: Optional[float] = typer.Option(None, "--memory-budget-mb"),
        repro: bool = typer.Option(
            False, "--repro", help="the nightly run also runs the bitwise reproducibility gate (docs/checks.md)"
        ),
        drill_resume: bool = typer.Option(
            False,
            "--drill-resume",
            help="the nightly run also runs the kill-and-resume drill (docs/checks.md; keep iterations short)",
        ),
    ) -> None:
        """Serve the `nightly-alignment` deployment (alignment_check on a cron schedule); blocks."""

        base = {"run": "nightly"} if not config and not any(s.startswith("run=") for s in sets or []) else None
        cfg = build_config(config, sets, base)
        quiet_prefect_console()
        api = ensure_prefect_api()
        # lazy: keeps torch/prefect out of CLI start-up
        from rollflow.flows.alignment import FLOW_NAME, NIGHTLY, register_nightly, serve_nightly

        if register_only:
            dep_id = register_nightly(
                cron, cfg, memory_budget_mb=memory_budget_mb, reproducibility=repro, resume_drill=drill_resume
            )
            console.print(
                f"registered {FLOW_NAME}/{NIGHTLY} ({dep_id}), cron {cron!r} UTC, run {cfg.run!r}; "
                f"runs execute while `rollflow serve` runs. UI: {api.removesuffix('/api')}"
            )
            return
        console.print(f"serving {FLOW_NAME}/{NIGHTLY}, cron {cron!r} UTC, run {cfg.run!r} (Ctrl-C stops)")
        serve_nightly(cron, cfg, memory_budget_mb=memory_budget_mb, reproducibility=repro, resume_drill=drill_resume)
