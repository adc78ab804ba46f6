"""Off-policy pipelining (issue 22, docs/async.md): one-step-off async training, dynamic sampling,
partial rollouts, kill + resume of an async run."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollflow.artifacts.pipeline_meta import filtered_reason, token_weight_versions
from rollflow.artifacts.sample import Sample, Status
from rollflow.artifacts.store import RolloutStore
from tests.conftest import small_config

REPO = Path(__file__).resolve().parents[1]


def task_runs_by_name(flow_name_prefix: str) -> dict[str, list[tuple[float, float]]]:
    """(start, end) epoch seconds of every finished task run of the flow runs named `prefix*`, by task name,
    read back from the Prefect API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, TaskRunFilter, TaskRunFilterFlowRunId

    async def read() -> dict[str, list[tuple[float, float]]]:
        async with get_client() as client:
            flows = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=flow_name_prefix))
            )
            ids = [f.id for f in flows if f.name.startswith(flow_name_prefix)]
            runs, page = [], None
            while page is None or len(page) == 200:  # the API's page size at most
                page = await client.read_task_runs(
                    task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=ids)),
                    limit=200,
                    offset=len(runs),
                )
                runs += page
        out: dict[str, list[tuple[float, float]]] = {}
        for run in runs:
            if run.start_time and run.end_time:
                name = run.name.rsplit("-", 1)[0]  # task run names end in a counter
                out.setdefault(name, []).append((run.start_time.timestamp(), run.end_time.timestamp()))
        return out

    return asyncio.run(read())


def overlap_s(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


def learning_config(root, run: str, iterations: int, staleness: int):
    # The demo recipe (docs/architecture.md section 10: 256 prompts x 8 samples, 8 optimizer steps); smaller
    # batches show no clear gain in a few iterations.
    from rollflow.flows.config import RunConfig

    return RunConfig.model_validate(
        {"run": run, "iterations": iterations, "store": {"root": str(root)}, "pipeline": {"max_staleness": staleness}}
    )


@pytest.mark.slow
def test_async_generate_next_overlaps_train_and_run_learns(tmp_path, prefect_api, ray_local):
    from rollflow.flows.train import rl_train

    cfg = learning_config(tmp_path, "async-learn", iterations=5, staleness=1)
    summary = rl_train(cfg)
    assert summary["iterations"] == 5
    rows = [json.loads(line) for line in (tmp_path / "async-learn" / "metrics.jsonl").read_text().splitlines()]
    # one step off: rollout r (r >= 1) was generated with weights r - 1 and trained by the trainer at version r
    store = RolloutStore(str(tmp_path))
    for r in range(5):
        versions = {s.weight_version for s in store.load("async-learn", "train", r).samples}
        assert versions == {max(0, r - 1)}, (r, versions)
        assert rows[r]["pipeline/staleness_max"] == (1 if r else 0)
        assert rows[r]["sync/weight_version"] == r + 1 and rows[r]["sync/parity_ok"] == 1.0
    # the Prefect API's task run times: each train of rollout r overlaps the generate of rollout r + 1
    runs = task_runs_by_name("async-learn/iter-")
    trains, nexts = sorted(runs["train"]), sorted(runs["generate-train"])
    assert len(trains) == 5 and len(nexts) == 5  # rollout 0 in iteration 1, rollouts 1-4 beside trains 0-3
    for r in range(4):
        assert overlap_s([trains[r]], [nexts[r + 1]]) > 0.05, (r, trains[r], nexts[r + 1])
    # it learns: the later rollouts' mean reward is above the first ones' (a run at lr 0 stays flat,
    # docs/architecture.md section 10)
    rewards = [row["rollout/raw_reward"] for row in rows]
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.02, rewards


# ----------------------------------------------------------------------------- partial rollouts
def test_partial_rollout_continues_aborted_samples_with_per_token_versions(tmp_path):
    """An abort mid-generation keeps tokens + log-probs; the next rollout continues them under new weights."""
    from typer.testing import CliRunner

    from rollflow.artifacts.manifest import EngineInfo
    from rollflow.flows.cli import app
    from rollflow.tasks.rollout.partial import defer_aborted
    from rollflow.tasks.rollout.settings import DataConfig, RolloutConfig
    from rollflow.tasks.rollout.worker import RolloutWorker
    from tests.hf_fixtures import build_model_dir

    # A random tiny model rarely emits its eos, so its generations run until the budget or an abort.
    model = build_model_dir(tmp_path / "model", arch="qwen2", chat_template=False)
    rollout = RolloutConfig(max_new_tokens=48, n_samples_per_prompt=2, reward="exact_match")
    worker = RolloutWorker(str(model), rollout, DataConfig(prompts_per_rollout=3))
    # The control thread's abort, fired deterministically at the 6th decode step (a forward hook on the model).
    steps = []

    def abort_at_step_6(*args) -> None:
        steps.append(1)
        if len(steps) == 6:
            worker.abort()

    hook = worker.engine.model.register_forward_hook(abort_at_step_6)
    first = worker.rollout(1)
    hook.remove()
    aborted = [s for s in first if s.status is Status.ABORTED]
    assert aborted and all(0 < s.response_length < 48 for s in aborted)
    assert all(len(s.rollout_log_probs) == s.response_length for s in aborted)
    for s in first:
        s.reward = 0.0
    store = RolloutStore(str(tmp_path / "root"))
    store.write(
        "p",
        "train",
        1,
        defer_aborted(first, 2),
        n_samples_per_prompt=2,
        engine=EngineInfo(backend="hf", model="m", weight_version=0),
        config_hash="h",
    )
    committed = store.load("p", "train", 1).samples
    deferred = [s for s in committed if filtered_reason(s) == "aborted"]
    assert {s.group_index for s in deferred} == {s.group_index for s in aborted}

    # New weights (version 1), then rollout 2 continues the deferred groups before its own prompts.
    weights = {k: v + 0.01 for k, v in worker.named_weights().items()}
    worker.update_weights(weights, 1)
    second = worker.rollout(2, continue_from=f"{tmp_path}/root/p/rollouts/train/000001", max_staleness=2)
    continued = [s for s in second if s.metadata.get("continued_from")]
    assert len(continued) == len(aborted)
    by_index = {s.index: s for s in deferred}
    for s in continued:
        old = by_index[s.metadata["continued_from"]["index"]]
        k = old.response_length
        assert s.tokens[: len(old.tokens)] == old.tokens  # the kept tokens, then new ones
        assert s.response_length > k
        assert s.rollout_log_probs[:k] == pytest.approx(old.rollout_log_probs, abs=0)
        assert token_weight_versions(s) == [0] * k + [1] * (s.response_length - k)
        assert s.weight_version == 1 and s.status in (Status.COMPLETED, Status.TRUNCATED)
    n_deferred_groups = len({s.group_index for s in deferred})
    assert len(second) == 2 * (3 + n_deferred_groups)  # continued groups (whole) + this rollout's 3 prompts
    # Sample-level checks of the whole continued groups: their completed samples come back unchanged.
    assert [s.tokens for s in second[: 2 * n_deferred_groups] if not s.metadata.get("continued_from")] == [
        s.tokens for s in deferred if s.status is not Status.ABORTED
    ]
    for s in second:
        s.reward = 0.0
    store.write(
        "p",
        "train",
        2,
        second,
        n_samples_per_prompt=2,
        engine=EngineInfo(backend="hf", model="m", weight_version=1),
        config_hash="h",
    )
    # `rollflow show` names each token run's version
    s = continued[0]
    k = s.response_length - token_weight_versions(s).count(1)
    res = CliRunner().invoke(
        app, ["show", str(tmp_path / "root" / "p"), "--id", "2", "--max-chars", "200"], env={"COLUMNS": "400"}
    )
    assert res.exit_code == 0, res.output
    assert f"v0x{k}+v1x{s.response_length - k}" in res.output
    res = CliRunner().invoke(app, ["show", str(tmp_path / "root" / "p"), "--id", "2", "--json", "--limit", "100"])
    shown = json.loads(res.output[res.output.index("{") :])
    assert any(rec["metadata"].get("weight_versions") == token_weight_versions(s) for rec in shown["samples"])


def test_a_group_cut_twice_is_dropped_or_finished_before_the_sync(tmp_path):
    """pipeline.stale_policy at max_staleness=2: a group cut in rollout 1 (weights 0) and cut again while rollout 2
    continues it (weights 1) would hold v0 tokens when rollout 3 is trained by trainer 3 (3 versions). drop: the
    continuing rollout marks it `stale`, its rows counted as dropped; wait: it is picked before the sync of
    rollout 2 and finished under weights 1, trained in rollout 2 with nothing older than 2 versions."""
    from rollflow.artifacts.manifest import EngineInfo
    from rollflow.artifacts.pipeline_meta import pipeline_stats
    from rollflow.tasks.rollout.partial import defer_aborted, mark_waited, too_old_to_continue
    from rollflow.tasks.rollout.settings import DataConfig, RolloutConfig
    from rollflow.tasks.rollout.worker import RolloutWorker
    from tests.hf_fixtures import build_model_dir

    model = build_model_dir(tmp_path / "model", arch="qwen2", chat_template=False)  # rarely emits eos
    rollout = RolloutConfig(max_new_tokens=48, n_samples_per_prompt=2, reward="exact_match")
    worker = RolloutWorker(str(model), rollout, DataConfig(prompts_per_rollout=3))
    store = RolloutStore(str(tmp_path / "root"))

    def cut_at_forward(k: int):
        calls = []

        def hook(*args) -> None:
            calls.append(1)
            if len(calls) == k:
                worker.abort()

        return worker.engine.model.register_forward_hook(hook)

    def commit(rollout_id: int, samples: list[Sample], version: int, run: str = "p") -> str:
        for s in samples:
            s.reward = 0.0
        engine = EngineInfo(backend="hf", model="m", weight_version=version)
        store.write(run, "train", rollout_id, samples, n_samples_per_prompt=2, engine=engine, config_hash="h")
        return f"{tmp_path}/root/{run}/rollouts/train/{rollout_id:06d}"

    hook = cut_at_forward(6)
    first = defer_aborted(worker.rollout(1), 2)
    hook.remove()
    once = {s.group_index for s in first if filtered_reason(s) == "aborted"}
    assert once
    # continued by trainer 2 the v0 tokens are 2 versions old: within the bound, nothing to wait for
    assert too_old_to_continue(first, 2, 2) == set()
    uri1 = commit(1, first, 0)

    worker.update_weights({k: v + 0.01 for k, v in worker.named_weights().items()}, 1)
    hook = cut_at_forward(3)  # the continuation runs first: cut again after two more tokens
    second = defer_aborted(worker.rollout(2, continue_from=uri1, max_staleness=2), 2)
    hook.remove()
    twice = {
        s.group_index
        for s in second
        if filtered_reason(s) == "aborted" and s.metadata.get("continued_from") and 0 in token_weight_versions(s)
    }
    assert twice, [(s.group_index, s.status, s.metadata) for s in second]
    # trainer 3 would train v0 tokens: 3 > 2; groups first cut under weights 1 are fine (3 - 1 = 2)
    late = too_old_to_continue(second, 3, 2)
    assert late == twice
    assert too_old_to_continue(second, 3, 3) == set()  # a looser bound keeps them

    # wait: finished now, under weights 1 (the sync has not happened), back in place and trained in rollout 2
    done = {s.index: s for s in mark_waited(worker.finish_aborted(2, [s for s in second if s.group_index in late]))}
    waited = [done.get(s.index, s) if s.group_index in late else s for s in second]
    for s in waited:
        if s.group_index in late:
            assert filtered_reason(s) is None and s.status in (Status.COMPLETED, Status.TRUNCATED)
            assert set(token_weight_versions(s)) <= {0, 1} and s.metadata.get("waited_at_sync") is True
    commit(2, waited, 1)
    stats = pipeline_stats(store.load("p", "train", 2).columns, trainer_version=2, group_size=2)
    assert stats.staleness_max <= 2 and stats.dropped_samples == 0
    assert stats.waited_samples == 2 * len(late)

    # drop: rollout 2 committed with the groups still deferred (another run); rollout 3 (trainer 3) drops them
    uri2 = commit(2, second, 1, run="p-drop")
    worker.update_weights({k: v + 0.01 for k, v in worker.named_weights().items()}, 2)
    third = worker.rollout(3, continue_from=uri2, max_staleness=2)
    stale = [s for s in third if filtered_reason(s) == "stale"]
    # the same samples, not generated further (group indices are renumbered per rollout: compare tokens)
    assert sorted(s.tokens for s in stale) == sorted(s.tokens for s in second if s.group_index in late)
    commit(3, third, 2, run="p-drop")
    stats = pipeline_stats(store.load("p-drop", "train", 3).columns, trainer_version=3, group_size=2)
    assert stats.dropped_samples == 2 * len(late) and stats.filtered_groups["stale"] == len(late)
    assert stats.staleness_max <= 2  # what is trained stays within the bound


# ----------------------------------------------------------------------------- dynamic sampling
def half_constant(sample: Sample) -> float:
    """A reward for the dynamic sampling test: prompts with an even first operand get 0 for every sample (a
    constant group); the others alternate 0 / 1 over consecutive samples (never constant)."""
    if int(str(sample.prompt)[:3]) % 2 == 0:
        return 0.0
    return float(sample.index % 2)


@pytest.mark.slow
def test_dynamic_sampling_trains_full_batches_of_nonconstant_groups(tmp_path, prefect_api, ray_local):
    from rollflow.flows.train import rl_train

    cfg = small_config(
        tmp_path,
        run="dyn",
        iterations=2,
        pipeline={"max_staleness": 1, "dynamic_sampling": {"enabled": True, "max_tries": 6}},
        data={"prompts_per_rollout": 8, "eval_prompts": 8},
        rollout={"n_samples_per_prompt": 4, "reward": "tests.test_async_pipeline:half_constant"},
        train={"num_steps_per_rollout": 1, "micro_batch_size": 32},
    )
    rl_train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "dyn" / "metrics.jsonl").read_text().splitlines()]
    store = RolloutStore(str(tmp_path))
    for r, row in enumerate(rows):
        samples = store.load("dyn", "train", r).samples
        groups: dict[int, list[Sample]] = {}
        for s in samples:
            groups.setdefault(s.group_index, []).append(s)
        trained = [g for g in groups.values() if not filtered_reason(g[0])]
        filtered = [g for g in groups.values() if filtered_reason(g[0])]
        assert len(trained) == 8 and all(len({s.reward for s in g}) > 1 for g in trained), r
        assert filtered, "over-sampling drew constant groups, kept in the artifact"
        constant = [g for g in filtered if len({s.reward for s in g}) == 1]
        assert all(filtered_reason(g[0]) == "filter" for g in constant)
        assert all(filtered_reason(g[0]) == "surplus" for g in filtered if g not in constant)
        assert all(len({filtered_reason(s) for s in g}) == 1 for g in groups.values())  # whole groups marked
        assert row["train/n_samples"] == 32  # 8 groups x 4 trained, nothing else
        assert row["pipeline/filtered_groups_filter"] == len(constant)
        assert row["pipeline/filtered_groups_surplus"] == len(filtered) - len(constant)


# ----------------------------------------------------------------------------- kill + resume
ITERATIONS, DEPTH = 4, 2  # rollouts 0-2 from weights 0 (the queue filled in iteration 1), rollout 3 from weights 1


def _async_sets(root, run: str) -> list[str]:
    return [
        f"run={run}",
        f"iterations={ITERATIONS}",
        f"store.root={root}",
        "data.prompts_per_rollout=32",
        "rollout.n_samples_per_prompt=4",
        "train.num_steps_per_rollout=1",
        "train.micro_batch_size=64",
        f"pipeline.max_staleness={DEPTH}",
    ]


def _final_weights(root, run: str, iteration: int) -> dict:
    import io

    import torch

    from rollflow.tasks.train.checkpoint import load_checkpoint

    return torch.load(io.BytesIO(load_checkpoint(str(root), run, iteration)), weights_only=True)["model"]


@pytest.mark.slow
def test_async_run_killed_and_resumed_matches_uninterrupted_run(tmp_path, prefect_api, ray_local):
    """SIGKILL of `rollflow train` (and its Ray workers) mid async run with a queue two rollouts deep, rerun: the
    final weights equal an uninterrupted async run's with the same seed, and nothing committed is regenerated."""
    import torch

    from rollflow.flows.config_loading import load_config
    from rollflow.flows.train import rl_train

    rl_train(load_config(None, _async_sets(tmp_path, "whole")))

    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "rollflow.flows.cli", "train"]
    for item in _async_sets(tmp_path, "killed"):
        cmd += ["--set", item]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    marker = tmp_path / "killed" / "checkpoints" / "000001" / "meta.json"
    deadline = time.monotonic() + 240
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)  # mid-run: the flow process and its Ray workers
    output = proc.communicate()[0].decode(errors="replace")
    assert alive, output[-3000:]
    rollouts = tmp_path / "killed" / "rollouts" / "train"
    before = {p.parent.name: p.read_bytes() for p in rollouts.glob("*/manifest.json")}
    assert {"000001", "000002"} <= set(before)  # the queue was committed before checkpoint 1 (beside train 0)
    assert not (tmp_path / "killed" / "checkpoints" / f"{ITERATIONS:06d}" / "meta.json").exists()

    summary = rl_train(load_config(None, _async_sets(tmp_path, "killed")))  # the rerun, here in-process
    assert summary["resumed_from"] >= 1
    after = {p.parent.name: p.read_bytes() for p in rollouts.glob("*/manifest.json")}
    assert sorted(after) == [f"{r:06d}" for r in range(ITERATIONS)]
    assert all(after[name] == manifest for name, manifest in before.items()), "a committed rollout was regenerated"
    store = RolloutStore(str(tmp_path))
    for r in range(ITERATIONS):
        killed = store.load("killed", "train", r).samples
        assert [s.tokens for s in killed] == [s.tokens for s in store.load("whole", "train", r).samples], r
        assert {s.weight_version for s in killed} == {max(0, r - DEPTH)}, r  # lock step, whatever the timing
    whole, resumed = _final_weights(tmp_path, "whole", ITERATIONS), _final_weights(tmp_path, "killed", ITERATIONS)
    assert sorted(whole) == sorted(resumed)
    assert all(torch.equal(whole[k], resumed[k]) for k in whole), "resumed async run ended on other weights"


# ----------------------------------------------------------------------------- config and group selection
def test_pipeline_config_errors_name_the_field_and_the_fix():
    from rollflow.flows.config_loading import ConfigError, load_config

    cases = {
        ("pipeline.max_staleness=1", "placement=colocate"): "pipeline.max_staleness=1 needs placement='disaggregated'",
        ("pipeline.partial_rollout=true", "pipeline.max_staleness=1"): "set pipeline.max_staleness=2",
        ("pipeline.max_staleness=1", "debug.rollout_only=true"): "set pipeline.max_staleness=0",
        ("pipeline.dynamic_sampling.enabled=true", "algo.advantage_estimator=ppo"): "pipeline.dynamic_sampling.enabled",
        ("pipeline.dynamic_sampling.filter_path=nocolon",): "expected 'module:function'",
    }
    for sets, expected in cases.items():
        with pytest.raises(ConfigError) as err:
            load_config(None, list(sets))
        assert expected in str(err.value), (sets, str(err.value))
    assert load_config(None, []).pipeline.max_staleness == 0  # default: today's synchronous loop


def test_off_policy_correction_is_on_by_default_for_async_runs_and_kept_in_their_replay():
    from rollflow.flows.config import RunConfig
    from rollflow.flows.config_loading import load_config

    sync = load_config(None, [])
    assert sync.algo.use_tis is False and not sync.notices
    deep = load_config(None, ["pipeline.max_staleness=3"])
    assert deep.algo.use_tis is True
    assert any("algo.use_tis=true" in n and "pipeline.max_staleness=3" in n for n in deep.notices), deep.notices
    assert load_config(None, ["pipeline.max_staleness=3", "algo.use_tis=false"]).algo.use_tis is False
    # excluded by slime's --use-rollout-logprobs (the ratio would be 1 by construction): not switched on
    assert load_config(None, ["pipeline.max_staleness=1", "algo.use_rollout_logprobs=true"]).algo.use_tis is False
    # the replay of an async run keeps its correction (pipelining itself has nothing to do there)
    replay = load_config(None, ["pipeline.max_staleness=3", "debug.train_only=true"])
    assert replay.algo.use_tis is True and any("no effect in a replay" in n for n in replay.notices)
    # a form or a dump carries the resolved value: the same config again
    assert RunConfig.model_validate(deep.model_dump()).algo.use_tis is True
    # the queue depth: N rollouts ahead without partial rollouts, one with them
    assert deep.pipeline.depth == 3 and sync.pipeline.depth == 0
    partial = load_config(None, ["pipeline.max_staleness=3", "pipeline.partial_rollout=true"])
    assert partial.pipeline.depth == 1
    # pipeline.stale_policy: drop by default; set without partial rollouts it has nothing to act on, and says so
    assert partial.pipeline.stale_policy == "drop"
    idle = load_config(None, ["pipeline.max_staleness=3", "pipeline.stale_policy=wait"])
    assert any(n.startswith("pipeline.stale_policy='wait' has nothing to act on") for n in idle.notices)
    # the default, as a form or a dump carries it: no notice
    drop = load_config(None, ["pipeline.max_staleness=3", "pipeline.stale_policy=drop"])
    assert drop.pipeline.stale_policy == "drop" and not any("stale_policy" in n for n in drop.notices)
    wait_sets = ["pipeline.max_staleness=2", "pipeline.partial_rollout=true", "pipeline.stale_policy=wait"]
    wait = load_config(None, wait_sets)
    assert wait.pipeline.stale_policy == "wait" and not any("stale_policy" in n for n in wait.notices)
    with pytest.raises(ValueError, match="stale_policy"):
        load_config(None, ["pipeline.stale_policy=later"])


@pytest.mark.slow
def test_queue_three_rollouts_deep_keeps_the_staleness_bound_in_lock_step(tmp_path, prefect_api, ray_local):
    """pipeline.max_staleness=3: rollout r comes from weights max(0, r - 3) (read back from the committed
    artifacts), no trained token is more than 3 versions old, one version per sample (no partial rollouts), the
    queue is filled in the first iteration and then holds what the trainer has not consumed, and the first
    iteration's train step overlaps the generation of the rollouts ahead (Prefect's task run times)."""
    from rollflow.artifacts.pipeline_meta import WEIGHT_VERSIONS
    from rollflow.flows.reporting import read_metrics
    from rollflow.flows.train import rl_train

    iterations, depth = 6, 3
    cfg = small_config(
        tmp_path,
        run="deep",
        iterations=iterations,
        eval_every=0,
        data={"prompts_per_rollout": 8},
        # Over-sampling re-draws prompts within a rollout (slime#2092: requeued samples spanned versions 2, 4 and 6
        # with partial rollouts off): every draw of rollout r still comes from weights r - 3, one version a sample.
        rollout={"reward": "tests.test_async_pipeline:half_constant"},
        pipeline={"max_staleness": depth, "dynamic_sampling": {"enabled": True, "max_tries": 3}},
    )
    state = rl_train(cfg, return_state=True)
    assert state.is_completed()
    rows = read_metrics(cfg)
    store = RolloutStore(str(tmp_path))
    for r, row in enumerate(rows):
        samples = store.load("deep", "train", r).samples
        assert {s.weight_version for s in samples} == {max(0, r - depth)}, r
        assert not any(s.metadata.get(WEIGHT_VERSIONS) for s in samples)
        trainer_version = r
        assert row["pipeline/staleness_max"] == trainer_version - max(0, r - depth) <= depth
        assert row["pipeline/versions_per_sample_max"] == 1.0
        assert row["train/tis"] > 0  # the correction is on (default for an async run)
        ahead = [j for j in range(r + 1, iterations) if j <= r + depth]
        assert row["pipeline/queue_depth"] == len(ahead), (r, row["pipeline/queue_depth"])
        assert row["sync/parity_ok"] == 1.0
    assert rows[0]["pipeline/generated_ahead"] == depth and rows[1]["pipeline/generated_ahead"] == 1
    assert "pipeline/generated_ahead" not in rows[-1]  # nothing left to generate beside the last train step
    runs = task_runs_by_name("deep/iter-")
    assert overlap_s(sorted(runs["train"])[:1], runs["generate-next"]) > 0.05
    assert len(runs["generate-train"]) > iterations  # over-sampling drew again
    assert "abort-generation" not in runs  # partial rollouts off: a generation is never cut
    # the settings the config took for the user (here the correction) are in the run's log, where a deployment's
    # user looks (rl_train logs its notices)
    implied = [n for n in cfg.notices if n.startswith("algo.use_tis=true")]
    assert implied and implied[0] in _flow_run_logs(state.state_details.flow_run_id, implied[0])


def _flow_run_logs(flow_run_id, needle: str, timeout: float = 30) -> str:
    """The flow run's log lines from the Prefect API (they arrive in batches, after the final state)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + timeout
    while True:
        with get_client(sync_client=True) as client:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        text = "\n".join(entry.message for entry in logs)
        if needle in text or time.monotonic() > deadline:
            return text
        time.sleep(1)


def _group(g: int, rewards: list[float]) -> list[Sample]:
    return [
        Sample(
            group_index=g,
            index=i,
            prompt="p",
            tokens=[1, 2, 3],
            response="x",
            response_length=1,
            loss_mask=[1],
            rollout_log_probs=[-0.5],
            reward=r,
        )
        for i, r in enumerate(rewards)
    ]


def test_group_selection_trains_target_groups_and_marks_the_rest():
    from rollflow.artifacts.columns import SampleColumns
    from rollflow.artifacts.pipeline_meta import pipeline_stats, trained_rows
    from rollflow.tasks.rollout.dynamic_sampling import reward_not_constant, select_groups

    groups = [_group(0, [1, 1]), _group(1, [0, 1]), _group(2, [0, 0]), _group(3, [1, 0]), _group(4, [0, 1])]
    keep = [reward_not_constant(g) for g in groups]
    assert keep == [False, True, False, True, True]
    chosen = select_groups(groups, keep, target=2)
    assert [filtered_reason(g[0]) for g in chosen.groups] == ["filter", None, "filter", None, "surplus"]
    assert chosen.passed == 3 and chosen.short == 0
    samples = chosen.samples()
    assert [s.group_index for s in samples] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    columns = SampleColumns.from_samples(samples)
    assert trained_rows(columns).numpy("group_index").tolist() == [1, 1, 3, 3]
    stats = pipeline_stats(columns, trainer_version=0, group_size=2)
    assert stats.filtered_groups == {"filter": 2, "surplus": 1}
    # tries exhausted with one passing group: topped up with the first failing one (its advantages are 0)
    short = select_groups(groups[:3], keep[:3], target=2)
    assert [filtered_reason(g[0]) for g in short.groups] == [None, None, "filter"] and short.short == 1
