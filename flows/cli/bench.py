"""`rollflow bench`: the benchmark suites (benchmarks/, issue 11) behind the CLI.

The root app (flows/cli/root.py) calls `register(app)` next to the other wings' `register`. The
benchmarks package lives at the repository root (not in the wheel), so the command runs from a checkout,
as a subprocess (`python -m benchmarks ...` there): flows/ never imports benchmarks/.
"""

from __future__ import annotations

from typing import List, Optional

import typer


def register(app: typer.Typer) -> None:
    @app.command("bench", context_settings={"allow_extra_args": False})
    def bench(
        suite: Optional[List[str]] = typer.Option(
            None,
            "--suite",
            "-s",
            help="orchestration, artifact_io, rollout, train, sync, replay, async, watchdog, cluster, e2e (or "
            "1-10); repeatable; default all",
        ),
        quick: bool = typer.Option(False, "--quick", help="small sizes, fewer repeats"),
        out: Optional[str] = typer.Option(None, "--out", help="JSON path (default benchmarks/results/...)"),
        repeats: Optional[int] = typer.Option(None, "--repeats", help="timed repeats per figure"),
        device: str = typer.Option("auto", "--device", help="auto, cpu or cuda"),
        shape: Optional[str] = typer.Option(
            None, "--shape", help="e2e suite: tiny | small | 0.5b | 1.5b | 3b | 5b (default: 0.5b on CUDA, tiny on CPU)"
        ),
    ) -> None:
        """Run the benchmark suites: print a table of every figure and ratio, write JSON."""
        import os
        import subprocess
        import sys
        from pathlib import Path

        # A subprocess (`python -m benchmarks` from the checkout): the product never imports its benchmarks.
        checkout = Path(__file__).resolve().parents[2]  # flows/cli/bench.py -> the checkout
        if not (checkout / "benchmarks" / "cli.py").exists():
            raise typer.BadParameter(
                f"the benchmarks package is not in {checkout}; run from a rollflow checkout"
            ) from None
        argv: list[str] = [sys.executable, "-m", "benchmarks"]
        for name in suite or []:
            argv += ["--suite", name]
        if quick:
            argv.append("--quick")
        if out:
            argv += ["--out", out]
        if repeats is not None:
            argv += ["--repeats", str(repeats)]
        argv += ["--device", device]
        if shape:
            argv += ["--shape", shape]
        # Same working directory as the command (relative --out paths unchanged); the checkout on the path.
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(checkout), os.environ.get("PYTHONPATH")) if p)
        )
        raise typer.Exit(subprocess.run(argv, env=env).returncode)
