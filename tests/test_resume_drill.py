"""The kill-and-resume drill (flows/resume_drill.py): a resumed run equals the uninterrupted one, and an injected
resume bug (the data cursor restarting at 0) is caught, naming the first differing value."""

from __future__ import annotations

import pytest

from rollflow.flows.config import RunConfig
from rollflow.flows.resume_drill import drill_config, kill_point, run_resume_drill
from rollflow.tasks.debug.resume_bug import with_resume_bug
from rollflow.tasks.rollout.addition import addition_prompts
from rollflow.tasks.rollout.settings import DataConfig, prompts_for


def test_kill_point_is_seeded_and_leaves_an_iteration_to_resume():
    points = {kill_point(5, seed) for seed in range(50)}
    assert points <= {1, 2, 3, 4} and len(points) > 1
    assert kill_point(5, 7) == kill_point(5, 7)
    with pytest.raises(ValueError, match="at least 2"):
        kill_point(1, 0)


def test_drill_legs_are_fresh_runs_with_a_checkpoint_every_iteration(tmp_path):
    cfg = RunConfig(run="exp", iterations=4, checkpoint_every=2, eval_every=1, store={"root": str(tmp_path)})
    ref, drill = drill_config(cfg, "ref"), drill_config(cfg, "drill")
    assert (ref.run, drill.run) == ("exp-resume-ref", "exp-resume-drill")
    assert ref.checkpoint_every == 1 and ref.eval_every == 0 and ref.iterations == 4


def test_the_injected_resume_bug_restarts_the_cursor_only_when_on_and_resuming(monkeypatch):
    data = DataConfig(prompts_per_rollout=4, seed=5)
    monkeypatch.delenv("ROLLFLOW_FAULT", raising=False)
    assert with_resume_bug(data, 3) is data
    monkeypatch.setenv("ROLLFLOW_FAULT", "resume-resets-data-cursor")
    assert with_resume_bug(data, 0) is data
    buggy = with_resume_bug(data, 3)
    # rollout 3 of the buggy resume draws the prompts of rollout 0 (the built-in task: seed + rollout id)
    assert [p.prompt for p in prompts_for(buggy, 3)] == [p.prompt for p in addition_prompts(4, seed=5)]
    assert [p.prompt for p in prompts_for(data, 3)] == [p.prompt for p in addition_prompts(4, seed=8)]


@pytest.mark.slow
def test_drill_passes_on_the_default_and_catches_a_cursor_reset(tmp_path, prefect_api, monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", prefect_api)
    cfg = RunConfig(
        run="drill",
        iterations=3,
        store={"root": str(tmp_path)},
        data={"prompts_per_rollout": 16},
        rollout={"n_samples_per_prompt": 4},
        watchdog={"probe_every": 0},
    )
    report = run_resume_drill(cfg, seed=0)
    assert report.ok, report.check.message
    assert report.kill_after == kill_point(3, 0) and report.resumed_from >= report.kill_after
    bad = run_resume_drill(cfg, seed=0, inject_resume_bug=True, reuse_reference=True)
    assert not bad.ok
    # the first value that differs: the resumed iteration's sampled tokens (other prompts)
    assert f"iteration {bad.resumed_from + 1}, token ids" in bad.check.message, bad.check.message
