"""`rollflow drill-resume`: the kill-and-resume drill (flows/resume_drill.py, docs/checks.md).

The root app (flows/cli/root.py) calls `register(app)`.
"""

from __future__ import annotations

from typing import List, Optional

import typer

from rollflow.flows.cli.common import ConfigOpt, SetOpt, build_config, console, ensure_prefect_api, user_errors


def register(app: typer.Typer) -> None:
    @app.command("drill-resume")
    def drill_resume(
        config: Optional[str] = ConfigOpt,
        sets: Optional[List[str]] = SetOpt,
        seed: int = typer.Option(0, "--seed", help="chooses the committed checkpoint the run is killed after"),
        inject_resume_bug: bool = typer.Option(
            False, "--inject-resume-bug", help="the resumed run's data cursor restarts at 0: the drill must fail"
        ),
    ) -> None:
        """Run the config straight through and again with a SIGKILL after a seeded committed checkpoint + resume;
        the two must be bitwise equal (rollouts, rewards, log-probs, losses, data cursor, final weights).
        Exit 1 on the first difference."""
        from rollflow.flows.preflight import preflight  # lazy: keeps torch/prefect out of CLI start-up
        from rollflow.flows.resume_drill import run_resume_drill  # lazy: keeps torch/prefect out of CLI start-up

        cfg = build_config(config, sets)
        with user_errors("drill-resume"):
            preflight(cfg, "train")
            ensure_prefect_api()  # the drill's `rollflow train` processes report to the same API
            report = run_resume_drill(cfg, seed=seed, inject_resume_bug=inject_resume_bug)
        verdict = "[green]PASS[/]" if report.ok else "[red]FAIL[/]"
        console.print(f"kill-and-resume drill {verdict}: {report.check.message}")
        raise typer.Exit(0 if report.ok else 1)
