"""`rollflow bench`: the benchmark suites (benchmarks/, issue 11) behind the CLI.

Wire it with `cli_bench.register(app)` next to the other `register` calls in flows/cli.py. The
benchmarks package lives at the repository root (not in the wheel), so the command runs from a checkout.
"""

from __future__ import annotations

from typing import List, Optional

import typer


def register(app: typer.Typer) -> None:
    @app.command("bench", context_settings={"allow_extra_args": False})
    def bench(
        suite: Optional[List[str]] = typer.Option(
            None, "--suite", "-s",
            help="orchestration, artifact_io, rollout, train, sync, replay (or 1-6); repeatable; default all"),
        quick: bool = typer.Option(False, "--quick", help="small sizes, fewer repeats"),
        out: Optional[str] = typer.Option(None, "--out", help="JSON path (default benchmarks/results/...)"),
        repeats: Optional[int] = typer.Option(None, "--repeats", help="timed repeats per figure"),
        device: str = typer.Option("auto", "--device", help="auto, cpu or cuda"),
    ) -> None:
        """Run the benchmark suites: print a table of every figure and ratio, write JSON."""
        import sys
        from pathlib import Path

        checkout = Path(__file__).resolve().parents[1]
        if (checkout / "benchmarks" / "cli.py").exists() and str(checkout) not in sys.path:
            sys.path.insert(0, str(checkout))  # an editable install maps only the packaged folders
        try:
            from benchmarks.cli import main as bench_main
        except ImportError as exc:
            raise typer.BadParameter(
                f"the benchmarks package is not importable ({exc}); run from a rollflow checkout") from None
        argv: list[str] = []
        for name in suite or []:
            argv += ["--suite", name]
        if quick:
            argv.append("--quick")
        if out:
            argv += ["--out", out]
        if repeats is not None:
            argv += ["--repeats", str(repeats)]
        argv += ["--device", device]
        raise typer.Exit(bench_main(argv))
