"""Terminal progress: one bar per iteration, advanced by the flows' stage calls."""

from __future__ import annotations

import contextlib
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from rollflow.flows import reporting

STAGES = ("start", "eval", "generate", "reward", "persist", "train", "sync", "checkpoint", "done")


@contextlib.contextmanager
def iteration_progress(console: Console | None = None) -> Iterator[Progress]:
    console = console or Console()
    progress = Progress(
        TextColumn("{task.description:<14}"),
        BarColumn(),
        TextColumn("{task.fields[stage]:<10}"),
        TimeElapsedColumn(),
        console=console,
    )
    bars: dict[object, int] = {}
    current: list[object] = []  # the key of the bar that stages without an iteration belong to

    def on_stage(name: str, iteration: int | None, line: str | None) -> None:
        if iteration is None and current:
            key: object = current[-1]
        else:
            key = iteration if iteration is not None else name
        if name == "done":
            current.clear()
        else:
            current[:] = [key]
        if key not in bars:
            label = f"iteration {key}" if isinstance(key, int) else str(key)
            bars[key] = progress.add_task(label, total=len(STAGES) - 1, stage=name)
        done = STAGES.index(name) if name in STAGES else 0
        progress.update(bars[key], completed=done, stage=name)
        if line:
            progress.console.print(line)

    token = reporting.STAGE_HOOK.set(on_stage)
    try:
        with progress:
            yield progress
    finally:
        reporting.STAGE_HOOK.reset(token)
