"""The kill-and-resume drill (docs/checks.md): a resumed run must be the run that was never interrupted.

Two runs of the same config, each a real `rollflow train` process: a reference that runs straight through, and a
drilled one SIGKILLed (its whole process group: driver, local Ray, actors) once a seeded checkpoint is committed,
then started again with the same command, so it resumes. The drilled run's next rollout id, data cursor, sampling
(token ids), rewards, log-probs, losses, per-step statistics and final weights must equal the reference's bit for
bit (`tasks/debug/repro.py` names the first value that differs), and every checkpoint's saved data cursor too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rollflow.flows.config import RunConfig
from rollflow.flows.repro_gate import clear_run, read_trace
from rollflow.tasks.debug.checks import FAIL, PASS, CheckResult
from rollflow.tasks.debug.repro import repro_check
from rollflow.tasks.train.checkpoint import checkpoint_status, load_checkpoint_meta

DRILL = "kill_and_resume"
RUN_TIMEOUT_S = 900.0


@dataclasses.dataclass(frozen=True)
class DrillReport:
    kill_after: int  # the committed checkpoint the kill waited for
    resumed_from: int  # the last committed checkpoint when the run was started again
    check: CheckResult

    @property
    def ok(self) -> bool:
        return self.check.status == PASS


def drill_config(cfg: RunConfig, label: str) -> RunConfig:
    """The drill's own run per leg: a fresh start, a checkpoint every iteration, no eval (eval is not compared)."""
    data = cfg.model_dump()
    data.update(run=f"{cfg.run[:86]}-resume-{label}", resume=True, resume_from=None, eval_every=0, checkpoint_every=1)
    return RunConfig.model_validate(data)


def kill_point(iterations: int, seed: int) -> int:
    """A committed checkpoint strictly before the last iteration, chosen by `seed` (so a failure replays)."""
    if iterations < 2:
        raise ValueError(f"iterations={iterations}: the drill needs at least 2 (a kill point before the last)")
    return random.Random(seed).randint(1, iterations - 1)


def _committed(cfg: RunConfig) -> list[int]:
    return checkpoint_status(cfg.store.root, cfg.run)[0]


def run_train(cfg: RunConfig, *, kill_after: int | None = None, env: dict[str, str] | None = None) -> None:
    """`rollflow train --config` in its own session; with `kill_after`, SIGKILL the whole session once that
    checkpoint is committed. Without it the run must exit 0. Its output goes to a file (a pipe nobody reads while
    the drill waits for the checkpoint would fill and block the run); a leg that fails says why with its tail."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cfg.model_dump(mode="json"), f)
    cmd = [sys.executable, "-m", "rollflow.flows.cli", "train", "--config", f.name]
    log = tempfile.NamedTemporaryFile("w+b", suffix=".log", delete=False)
    proc = subprocess.Popen(
        cmd, env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )

    def tail() -> str:
        log.flush()
        return Path(log.name).read_bytes()[-3000:].decode(errors="replace")

    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        if kill_after is not None:
            while kill_after not in _committed(cfg):
                if proc.poll() is not None or time.monotonic() > deadline:
                    how = f"exited {proc.returncode}" if proc.returncode is not None else f"ran {RUN_TIMEOUT_S:.0f} s"
                    raise RuntimeError(f"run {cfg.run!r} {how} before checkpoint {kill_after} was committed:\n{tail()}")
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
            return
        try:
            proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"run {cfg.run!r} ran {RUN_TIMEOUT_S:.0f} s without finishing:\n{tail()}") from None
        if proc.returncode != 0:
            raise RuntimeError(f"run {cfg.run!r} exited {proc.returncode}:\n{tail()}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        Path(log.name).unlink(missing_ok=True)
        Path(f.name).unlink(missing_ok=True)


def cursor_difference(a: RunConfig, b: RunConfig) -> str | None:
    """The first checkpoint whose saved data cursor differs between the two runs."""
    for iteration in _committed(a):
        saved_a = load_checkpoint_meta(a.store.root, a.run, iteration).get("data")
        saved_b = load_checkpoint_meta(b.store.root, b.run, iteration).get("data")
        if saved_a != saved_b:
            return f"checkpoint {iteration}, data cursor: {saved_a!r} vs {saved_b!r}"
    return None


def drill_markdown(cfg: RunConfig, check: CheckResult) -> str:
    """The drill's report as markdown (the nightly flow's `{run}-resume-drill` artifact)."""
    lines = [
        f"# Kill-and-resume drill: run `{cfg.run}`",
        "",
        f"**Result: {check.status.upper()}** — {check.message}",
        "",
        f"Legs: `{drill_config(cfg, 'ref').run}` (straight through), `{drill_config(cfg, 'drill').run}` (SIGKILL "
        f"after a committed checkpoint, then resumed); {cfg.iterations} iterations, store `{cfg.store.root}`.",
    ]
    figures = {k: v for k, v in check.figures.items() if not isinstance(v, (dict, list))}
    if figures:
        lines += ["", "| figure | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in figures.items())]
    if check.causes:
        lines += ["", "Likely causes: " + "; ".join(check.causes)]
    return "\n".join(lines) + "\n"


def run_resume_drill(
    cfg: RunConfig, *, seed: int = 0, inject_resume_bug: bool = False, reuse_reference: bool = False
) -> DrillReport:
    """The reference run, the killed run, its resume; then the comparison. `inject_resume_bug`: the resumed run's
    data cursor restarts at 0 (tasks/debug/resume_bug.py) and the drill must fail. `reuse_reference`: keep the
    reference of an earlier drill of the same config (it is only read)."""
    reference, drilled = drill_config(cfg, "ref"), drill_config(cfg, "drill")
    clear_run(drilled)
    if not (reuse_reference and cfg.iterations in _committed(reference)):
        clear_run(reference)
        run_train(reference)
    kill_after = kill_point(cfg.iterations, seed)
    run_train(drilled, kill_after=kill_after)
    resumed_from = max(_committed(drilled))
    bug = {"ROLLFLOW_FAULT": "resume-resets-data-cursor"} if inject_resume_bug else {}
    run_train(drilled, env=bug)
    check = repro_check(read_trace(reference), read_trace(drilled))
    cursor = cursor_difference(reference, drilled)
    figures = dict(check.figures, kill_after=kill_after, resumed_from=resumed_from)
    if check.status == PASS and cursor is not None:
        check = CheckResult(DRILL, FAIL, figures, f"first differing value: {cursor}")
    else:
        summary = (
            f"killed after checkpoint {kill_after}, resumed from {resumed_from}: " + check.message
            if check.status == PASS
            else f"resumed from checkpoint {resumed_from} (killed after {kill_after}): {check.message}"
        )
        check = CheckResult(DRILL, check.status, figures, summary, list(check.causes))
    return DrillReport(kill_after, resumed_from, check)
