"""An injected resume bug for the kill-and-resume drill (docs/checks.md): the data cursor restarts at 0.

With `ROLLFLOW_FAULT=resume-resets-data-cursor` in the environment of a resuming `rollflow train`, the engine of the
resumed run draws rollout `start + r`'s prompts as if it were rollout `r` (the built-in task's cursor is
`data.seed + rollout_id`), as a resume that forgot the saved cursor would (slime#1558). The drill must catch it.
"""

from __future__ import annotations

import os

from rollflow.tasks.rollout.settings import DataConfig

FAULT_ENV = "ROLLFLOW_FAULT"
RESUME_RESETS_DATA_CURSOR = "resume-resets-data-cursor"


def with_resume_bug(data: DataConfig, start: int) -> DataConfig:
    """`data` unchanged unless the fault is on and the run resumes (start > 0)."""
    if start <= 0 or os.environ.get(FAULT_ENV) != RESUME_RESETS_DATA_CURSOR:
        return data
    # model_copy skips validation on purpose: the shifted seed may be negative (random.Random accepts it).
    return data.model_copy(update={"seed": data.seed - start})
