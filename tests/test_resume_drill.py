"""The kill-and-resume drill (flows/resume_drill.py): a resumed run equals the uninterrupted one, and an injected
resume bug (the data cursor restarting at 0) is caught, naming the first differing value."""

from __future__ import annotations

import pytest

from rollflow.flows.config import RunConfig
from rollflow.flows.resume_drill import drill_config, kill_point
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


def _task_states(flow_run_id) -> dict[str, str]:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {t.name.rsplit("-", 1)[0]: t.state.name for t in tasks if t.state is not None}


@pytest.mark.slow
def test_nightly_alignment_runs_the_drill_as_a_task_and_fails_on_the_resume_bug(
    tmp_path, prefect_api, ray_local, monkeypatch
):
    """`rollflow serve --drill-resume`: the scheduled run's parameters (JSON, as a schedule sends them) run the
    drill as the `resume-drill` task, green with a PASS artifact; with the resume bug injected into the
    environment the flow runs in (what the drill's `rollflow train` processes inherit), that task and the flow
    fail and the artifact names the first differing value."""
    from prefect.artifacts import Artifact

    from rollflow.flows.alignment import AlignmentFailed, alignment_check, nightly_parameters
    from tests.conftest import small_config

    monkeypatch.setenv("PREFECT_API_URL", prefect_api)  # the drill's `rollflow train` processes report here
    monkeypatch.delenv("ROLLFLOW_FAULT", raising=False)
    # the drill's `rollflow train` legs join the session's Ray cluster, as a nightly run's would join its cluster
    # (five local Ray starts cost the loaded CI host more than the legs' training)
    cfg = small_config(
        tmp_path, run="nightly-drill", iterations=2, data={"prompts_per_rollout": 8}, ray={"address": ray_local}
    )
    params = nightly_parameters(cfg, resume_drill=True)
    assert params["params"]["iterations"] == 2  # the nightly form carries the drill's length

    state = alignment_check(**params, return_state=True)
    assert state.is_completed(), state.result(raise_on_failure=False)
    drill = {c["name"]: c for c in state.result()["checks"]}["kill_and_resume"]
    assert drill["status"] == "pass" and drill["figures"]["kill_after"] == kill_point(2, 0), drill
    tasks = _task_states(state.state_details.flow_run_id)
    assert tasks["resume-drill"] == "Completed"
    assert "check-kill_and_resume" not in tasks  # the drill's own task is its verdict
    artifact = Artifact.get("nightly-drill-resume-drill")
    assert artifact is not None and "**Result: PASS**" in artifact.data

    monkeypatch.setenv("ROLLFLOW_FAULT", "resume-resets-data-cursor")
    # the straight-through reference never resumes, so the fault cannot touch it: the second drill reads the first
    # one's (same config, same code) instead of running it again, and runs only the killed and the resumed legs
    from rollflow.flows import alignment, resume_drill

    monkeypatch.setattr(
        alignment, "run_resume_drill", lambda cfg: resume_drill.run_resume_drill(cfg, reuse_reference=True)
    )
    state = alignment_check(**params, return_state=True)
    assert state.is_failed()
    exc = state.result(raise_on_failure=False)
    assert isinstance(exc, AlignmentFailed) and "kill_and_resume" in str(exc), exc
    tasks = _task_states(state.state_details.flow_run_id)
    assert tasks["resume-drill"] == "Failed"
    # the alignment checks themselves still pass: only the drill is red
    assert {name: s for name, s in tasks.items() if name.startswith("check-")} and all(
        s == "Completed" for name, s in tasks.items() if name.startswith("check-")
    ), tasks
    artifact = Artifact.get("nightly-drill-resume-drill")
    assert "**Result: FAIL**" in artifact.data and "iteration 2, token ids" in artifact.data, artifact.data
