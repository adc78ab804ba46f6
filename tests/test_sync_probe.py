"""The post-sync probe and the mismatch trend (issue 35, docs/checks.md).

Unit tests check the comparison and the slope against values worked out here by other means; the in-process
test trains one real step and shows the stale-serving fault passing every checksum while the probe fails; the
slow tests run `rollflow train` end to end with and without the fault.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from rollflow.artifacts.manifest import EngineInfo
from rollflow.artifacts.store import RolloutStore
from rollflow.flows.config import RunConfig
from rollflow.tasks.debug.stale_serving import StaleServingWorker
from rollflow.tasks.debug.trend import MISMATCH_KEY, least_squares_slope, mismatch_points, mismatch_trend
from rollflow.tasks.rollout.rewards import reward_fn_from_config, score_samples
from rollflow.tasks.rollout.settings import DataConfig, RolloutConfig
from rollflow.tasks.rollout.worker import RolloutWorker
from rollflow.tasks.sync.parity import compare
from rollflow.tasks.sync.probe import ProbeBounds, ProbeSpec, compare_probe
from rollflow.tasks.train.settings import AlgoConfig, OptimConfig
from rollflow.tasks.train.worker import TrainWorker


# -- the comparison ------------------------------------------------------------------------------------------
def test_probe_comparison_by_hand():
    engine = [[-1.0, -2.0], [-0.5]]
    trainer = [[-1.0005, -2.0], [-0.4995]]
    report = compare_probe(engine, trainer, dtype="float32", bound=1e-3, weight_version=3)
    # |d| = 5e-4, 0, 5e-4 -> mean 1e-3 / 3, max 5e-4
    assert report.mean_abs_diff == pytest.approx(1e-3 / 3, rel=1e-9)
    assert report.max_abs_diff == pytest.approx(5e-4, rel=1e-9)
    assert (report.tokens, report.sequences, report.ok) == (3, 2, True)
    tight = compare_probe(engine, trainer, dtype="float32", bound=1e-4, weight_version=3)
    assert not tight.ok
    line = tight.summary()
    assert "\n" not in line and "FAILED at weight version 3" in line
    assert "0.000333" in line and "bound 0.0001 for float32" in line and "over 3 tokens of 2 sequences" in line


def test_probe_comparison_refuses_and_fails():
    with pytest.raises(ValueError, match="2 sequences, the trainer 1"):
        compare_probe([[0.0], [0.0]], [[0.0]], dtype="float32", bound=1e-3, weight_version=1)
    with pytest.raises(ValueError, match="sequence 0: the engine scored 2 tokens, the trainer 1"):
        compare_probe([[0.0, 0.0]], [[0.0]], dtype="float32", bound=1e-3, weight_version=1)
    empty = compare_probe([[]], [[]], dtype="float32", bound=1e-3, weight_version=1)
    assert not empty.ok and "no token was generated" in empty.summary()
    assert not compare_probe([[math.nan]], [[0.0]], dtype="float32", bound=1e-3, weight_version=1).ok


def test_probe_bound_follows_the_least_precise_side():
    bounds = ProbeBounds(float32=1e-3, bfloat16=5e-2)
    assert bounds.for_dtypes("float32", "float32") == ("float32", 1e-3)
    assert bounds.for_dtypes("float64", "float32") == ("float32", 1e-3)
    assert bounds.for_dtypes("float32", "bfloat16") == ("bfloat16", 5e-2)
    assert bounds.for_dtypes("bfloat16", "auto") == ("bfloat16", 5e-2)


# -- the trend -----------------------------------------------------------------------------------------------
def test_slope_matches_numpy_polyfit():
    rng = random.Random(7)
    xs = [float(i) for i in range(3, 15)]
    ys = [0.01 + 0.0007 * x + rng.gauss(0, 1e-4) for x in xs]
    assert least_squares_slope(xs, ys) == pytest.approx(float(np.polyfit(xs, ys, 1)[0]), rel=1e-9)
    assert least_squares_slope([1, 2, 3], [5.0, 3.0, 1.0]) == pytest.approx(-2.0)
    with pytest.raises(ValueError, match="distinct"):
        least_squares_slope([2, 2], [1.0, 3.0])


def test_trend_verdicts():
    bounds = dict(window=4, warn_slope=5e-4, fail_slope=2e-3)

    def line(slope: float, n: int = 6, start: float = 0.01) -> list[tuple[int, float]]:
        return [(i, start + slope * i) for i in range(1, n + 1)]

    assert mismatch_trend(line(0.0), **bounds).verdict == "ok"
    assert mismatch_trend(line(-1e-3), **bounds).verdict == "ok"  # a falling mismatch is no alarm
    warn = mismatch_trend(line(1e-3), **bounds)
    assert warn.verdict == "warn" and warn.slope == pytest.approx(1e-3)
    assert (warn.first_iteration, warn.last_iteration) == (3, 6)  # the last `window` iterations only
    fail = mismatch_trend(line(3e-3), **bounds)
    assert fail.verdict == "fail" and "fail above 0.002" in fail.summary()
    assert mismatch_trend(line(1e-3, n=3), **bounds).verdict == "short"
    assert mismatch_trend([(1, 0.0), (2, 0.0), (3, math.nan), (4, 0.0)], **bounds).verdict == "fail"
    # a jump long ago is outside the window: only the recent, flat part counts
    assert mismatch_trend([(1, 0.5), *[(i, 0.01) for i in range(2, 8)]], **bounds).verdict == "ok"


def test_mismatch_points_skip_rows_without_the_metric():
    rows = [{"iteration": 1, MISMATCH_KEY: 0.1}, {"iteration": 2}, {"iteration": 3, MISMATCH_KEY: 0.3}]
    assert mismatch_points(rows) == [(1, 0.1), (3, 0.3)]


def test_trend_config_bounds():
    with pytest.raises(ValueError, match="at least 3 iterations"):
        RunConfig.model_validate({"watchdog": {"trend_window": 2}})
    with pytest.raises(ValueError, match="trend_fail_slope"):
        RunConfig.model_validate({"watchdog": {"trend_warn_slope": 1e-2, "trend_fail_slope": 1e-3}})


# -- in process: one real train step, then a sync into a fresh and into a stale-serving engine ------------------
def probe_diff(engine: RolloutWorker, trainer: TrainWorker, spec: ProbeSpec) -> float:
    samples = engine.probe(spec)
    return compare_probe(
        [s.rollout_log_probs for s in samples],
        trainer.score_probe(samples),
        dtype="float32",
        bound=1e-3,
        weight_version=1,
    ).mean_abs_diff


def test_stale_serving_passes_checksums_and_fails_the_probe(tmp_path):
    rollout = RolloutConfig(n_samples_per_prompt=4)
    data = DataConfig(prompts_per_rollout=32)
    optim = OptimConfig(num_steps_per_rollout=1, micro_batch_size=64)
    fresh = RolloutWorker("builtin:addition", rollout, data)
    stale = StaleServingWorker("builtin:addition", rollout, data)
    trainer = TrainWorker(
        "builtin:addition", optim, AlgoConfig(), store_root=str(tmp_path), run="probe", temperature=rollout.temperature
    )
    spec = ProbeSpec()
    assert probe_diff(fresh, trainer, spec) < 1e-4  # before any step: generation vs teacher-forced noise only

    samples = score_samples(fresh.rollout(0), reward_fn_from_config(rollout), reward_key=rollout.reward_key)
    ref = RolloutStore(str(tmp_path)).write(
        "probe",
        "train",
        0,
        samples,
        n_samples_per_prompt=4,
        config_hash="test",
        engine=EngineInfo(backend="hf", model="builtin:addition", weight_version=0),
    )
    trainer.train_on_artifact(ref)
    for engine in (fresh, stale):
        engine.update_weights(trainer.named_weights(), 1)
        assert compare(trainer.weight_checksums(), engine.weight_checksums()).ok  # every tensor checksum passes

    good, bad = probe_diff(fresh, trainer, spec), probe_diff(stale, trainer, spec)
    print(f"probe after one step: fresh engine {good:.3g}, stale-serving engine {bad:.3g}")
    assert good < 1e-4
    assert bad > 1e-3


# -- end to end: `rollflow train` ------------------------------------------------------------------------------
SMALL = [
    "data.prompts_per_rollout=32",
    "rollout.n_samples_per_prompt=4",
    "train.num_steps_per_rollout=1",
    "train.micro_batch_size=64",
    "checkpoint_every=1",
]


def rollflow_train(tmp_path, monkeypatch, run: str, *sets: str):
    from typer.testing import CliRunner

    from rollflow.flows.cli.root import app

    monkeypatch.setenv("ROLLFLOW_LOG_DIR", str(tmp_path / "logs"))
    args = ["train", "--set", f"store.root={tmp_path}", "--set", f"run={run}"]
    for item in [*SMALL, *sets]:
        args += ["--set", item]
    return CliRunner().invoke(app, args)


@pytest.mark.slow
def test_rollflow_train_records_the_probe(tmp_path, prefect_api, ray_local, monkeypatch):
    from rollflow.flows.reporting import read_metrics

    monkeypatch.setenv("PREFECT_API_URL", prefect_api)  # the session's API: start no server
    res = rollflow_train(tmp_path, monkeypatch, "probe-ok", "iterations=3", "watchdog.trend_window=3")
    assert res.exit_code == 0, res.output
    rows = read_metrics(RunConfig.model_validate({"run": "probe-ok", "store": {"root": str(tmp_path)}}))
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["sync/parity_ok"] == 1.0
        assert 0.0 <= row["sync/probe_logprob_diff"] < 1e-4  # fp32: generation vs teacher-forced noise only
        print(
            f"iteration {row['iteration']}: probe diff {row['sync/probe_logprob_diff']:.3g}, probe "
            f"{row['perf/sync_probe_s']:.3f} s of {row['perf/iteration_s']:.2f} s"
        )
    assert "mismatch/logprob_diff_slope" not in rows[1] and abs(rows[2]["mismatch/logprob_diff_slope"]) < 5e-4


@pytest.mark.slow
def test_rollflow_train_fails_the_sync_of_a_stale_serving_engine(tmp_path, prefect_api, ray_local, monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", prefect_api)
    res = rollflow_train(tmp_path, monkeypatch, "probe-stale", "iterations=2", "debug.serve_stale=true")
    assert res.exit_code != 0
    # Checksum parity ran first and passed (it would have failed the task with its own message); the probe then
    # failed it, its numbers on one line.
    lines = [line for line in res.output.splitlines() if "sync probe FAILED" in line]
    assert lines, res.output
    assert "weight version 1" in lines[0] and "bound 0.001 for float32" in lines[0]
    assert "mismatched" not in res.output


def test_trend_task_warns_green_and_fails_red(prefect_api, monkeypatch):
    from prefect import flow

    from rollflow.flows.mismatch_trend import mismatch_trend_task

    monkeypatch.setenv("PREFECT_API_URL", prefect_api)
    cfg = RunConfig()
    bounds = dict(window=4, warn_slope=5e-4, fail_slope=2e-3)
    warn = mismatch_trend([(i, 0.01 + 1e-3 * i) for i in range(1, 5)], **bounds)
    fail = mismatch_trend([(i, 0.01 + 5e-3 * i) for i in range(1, 5)], **bounds)

    @flow
    def judge(report) -> tuple[str, str]:
        state = mismatch_trend_task(cfg, report, return_state=True)
        return state.type.value, state.message or ""

    assert judge(warn)[0] == "COMPLETED"  # a warning: the task stays green
    kind, message = judge(fail)
    assert kind == "FAILED" and "mismatch trend fail" in message and "slope 0.005/iteration" in message


def test_async_runs_follow_the_probe_not_the_stale_train_rollout_gap(tmp_path):
    """An async run's train/rollout gap grows while its queue fills (rollouts 1-4 from weights 0 at
    max_staleness=4: the CPU benchmark's run failed the trend at 3.6e-7 -> 0.25 over 8 iterations), though the
    engine serves the trainer's weights exactly: the trend follows the post-sync probe there. A synchronous
    run with the same rows still fails."""
    import json

    from rollflow.flows.mismatch_trend import trend_with
    from tests.conftest import small_config

    def rows(run: str) -> list[dict]:
        gaps = [3.6e-7, 0.05, 0.10, 0.16, 0.21, 0.25, 0.25, 0.25]  # staleness 0, 1, 2, 3, 4, then steady
        return [
            {"iteration": i + 1, "train/train_rollout_logprob_abs_diff": gap, "sync/probe_logprob_diff": 2e-7}
            for i, gap in enumerate(gaps)
        ]

    for staleness, verdict, metric in ((4, "ok", "sync/probe_logprob_diff"), (0, "fail", MISMATCH_KEY)):
        run = f"trend-{staleness}"
        cfg = small_config(tmp_path, run=run, iterations=8, pipeline={"max_staleness": staleness})
        *history, last = rows(run)
        (tmp_path / run).mkdir()
        (tmp_path / run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
        report = trend_with(cfg, last)
        assert (report.verdict, report.metric) == (verdict, metric), report.summary()
