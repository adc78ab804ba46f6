"""Stage replay with expected values (issue 35, acceptance 4): `rollflow replay --stage ...`.

The comparisons on hand-built values; then, on one committed short run of the embedded default (2 iterations,
trained once per module), each stage replays clean and a changed reward function or loss coefficient exits 1
with a mismatch table naming the stage and the values."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollflow.tasks.debug.stage_replay import (
    EXACT,
    StageReplayReport,
    compare_metrics,
    compare_steps,
    compare_values,
    tolerance_for,
)

REPO = Path(__file__).resolve().parents[1]


def test_compare_values_with_dtype_tolerance():
    fp32 = tolerance_for("float32")
    ok = compare_values("advantage", 3, "advantage", [0.5, -0.5, None], [0.5 + 1e-9, -0.5, None], fp32)
    assert ok.ok and ok.compared == 2
    bad = compare_values("advantage", 3, "advantage", [0.5, -0.5], [0.5, -0.49], fp32)
    assert [(m.field, m.where, m.recorded, m.replayed) for m in bad.mismatches] == [
        ("advantage", "sample 1", -0.5, -0.49)
    ]
    assert compare_values("reward", 0, "reward", [1.0], [1.0 + 1e-12], EXACT).mismatches
    assert compare_values("reward", 0, "reward", [1.0, 0.0], [1.0], EXACT).mismatches[0].field == "reward (count)"
    assert tolerance_for("bfloat16").close(1.0, 1.01) and not fp32.close(1.0, 1.01)
    with pytest.raises(ValueError, match="float8"):
        tolerance_for("float8")


def test_compare_metrics_skips_timings_and_other_stages():
    recorded = {
        "train/loss": 0.25,
        "perf/iteration_s": 1.0,
        "sync/parity_ok": 1.0,
        "train/n_samples": 64.0,
        "rollout_uri": "/x",
        "train/pg_clipfrac": 0.1,
    }
    replayed = {"train/loss": 0.25, "perf/iteration_s": 2.0, "train/n_samples": 32.0, "train/pg_clipfrac": 0.2}
    result = compare_metrics("loss", 1, recorded, replayed, tolerance_for("float32"))
    assert result.compared == 2 and [m.field for m in result.mismatches] == ["train/pg_clipfrac"]
    steps = compare_steps(
        1, [{"train_step/loss": 1.0}], [{"train_step/loss": 1.0}, {"train_step/loss": 2.0}], tolerance_for("float32")
    )
    assert steps.mismatches[0].field == "optimizer steps (count)"


def test_report_round_trip_and_summary():
    bad = compare_values("reward", 0, "reward", [1.0], [0.0], EXACT)
    good = compare_values("reward", 1, "reward", [1.0], [1.0], EXACT)
    report = StageReplayReport("r", [bad, good])
    assert not report.ok and "reward (rollout 0)" in report.summary()
    again = StageReplayReport.from_dict(report.to_dict())
    assert again.mismatches == report.mismatches and not again.ok
    assert StageReplayReport("r", [good]).ok
    empty = compare_values("loss", 2, "x", [None], [None], EXACT)
    assert not StageReplayReport("r", [empty]).ok  # nothing compared is not a pass


# ---- end to end: one committed run, the CLI ------------------------------------------------------------------


def _cli(args: list[str], env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollflow.flows.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def committed_run(tmp_path_factory, prefect_api):
    """The embedded default, 2 iterations (checkpoint after each), trained once for the module."""
    root = tmp_path_factory.mktemp("stage")
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "COLUMNS": "200"}
    common = ["--set", f"store.root={root}", "--set", "iterations=2"]
    out = _cli(["train", "--set", "run=src", *common], env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return env, common


@pytest.mark.slow
def test_every_stage_replays_clean(committed_run):
    env, common = committed_run
    out = _cli(["replay", "--stage", "all", "--source-run", "src", "--ids", "0-1", "--set", "run=chk", *common], env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "values match" in out.stdout


@pytest.mark.slow
def test_changed_reward_function_fails_the_reward_stage(committed_run):
    env, common = committed_run
    out = _cli(
        [
            "replay",
            "--stage",
            "reward",
            "--source-run",
            "src",
            "--ids",
            "0",
            "--set",
            "run=chk",
            "--set",
            "rollout.reward=tests.reward_fixtures:last_digit",
            *common,
        ],
        env,
    )
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "stage replay mismatches" in out.stdout and "reward (rollout 0)" in out.stdout
    assert "│ reward │ 0" in out.stdout  # a table row: stage, rollout id, field, sample, both values


@pytest.mark.slow
def test_changed_loss_coefficient_fails_the_loss_stage(committed_run):
    env, common = committed_run
    out = _cli(
        [
            "replay",
            "--stage",
            "loss",
            "--source-run",
            "src",
            "--ids",
            "1",
            "--set",
            "run=chk",
            "--set",
            "algo.eps_clip=0.02",
            *common,
        ],
        env,
    )
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "loss (rollout 1)" in out.stdout and "pg_clipfrac" in out.stdout
    # the advantages do not depend on the clip: that stage still passes on the changed config
    ok = _cli(
        [
            "replay",
            "--stage",
            "advantage",
            "--source-run",
            "src",
            "--ids",
            "1",
            "--set",
            "run=chk",
            "--set",
            "algo.eps_clip=0.02",
            *common,
        ],
        env,
    )
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
