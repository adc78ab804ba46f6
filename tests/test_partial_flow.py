"""Partial rollouts through the real rl_train flow (issue 36 item 5; docs/async.md): the abort at sync, the
continuation in the next iteration, what `rollflow show` prints of it, and a replay of the async run's artifacts.

One async run (3 iterations, pipeline.partial_rollout) is shared by the tests of this module. Its rollout 1 is
generated beside the train of rollout 0 and group 0 of it waits for the flow's abort (tests/partial_fixtures.py),
so the abort always finds that group in flight. Expectations are read from the committed parquet and manifest
files with pyarrow and json, not through rollflow's readers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import small_config
from tests.partial_fixtures import HELD_GROUP

pytestmark = pytest.mark.slow  # the shared run takes ~20 s, the replay ~6 s more

RUN = "partial"
N = 4  # samples per prompt
PROMPTS = 16


def rows_of(root: Path, run: str, rollout_id: int) -> list[dict]:
    folder = root / run / "rollouts" / "train" / f"{rollout_id:06d}"
    manifest = json.loads((folder / "manifest.json").read_text())
    rows = pq.read_table(folder / "samples.parquet").to_pylist()
    assert manifest["n_samples"] == len(rows)
    for row in rows:
        row["metadata"] = json.loads(row["metadata"])
    return rows


def trained(rows: list[dict]) -> list[dict]:
    return [r for r in rows if not r["metadata"].get("filtered")]


def version_runs(versions: list[int]) -> str:
    """`v0x1+v1x4`: the runs of equal versions, written out here rather than taken from rollflow."""
    runs: list[list[int]] = []
    for v in versions:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return "+".join(f"v{v}x{n}" for v, n in runs)


def task_names_by_flow_run(prefix: str) -> dict[str, list[str]]:
    """Task run names (counter suffix dropped) of every flow run named `prefix*`, from the Prefect API."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, TaskRunFilter, TaskRunFilterFlowRunId

    async def read() -> dict[str, list[str]]:
        async with get_client() as client:
            flows = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=prefix)))
            names = {f.id: f.name for f in flows if f.name.startswith(prefix)}
            runs = await client.read_task_runs(
                task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=list(names))), limit=200
            )
        out: dict[str, list[str]] = {name: [] for name in names.values()}
        for run in runs:
            out[names[run.flow_run_id]].append(run.name.rsplit("-", 1)[0])
        return out

    return asyncio.run(read())


@pytest.fixture(scope="module")
def partial_run(tmp_path_factory, prefect_api, ray_local) -> tuple[Path, list[dict]]:
    from rollflow.flows.train import rl_train

    root = tmp_path_factory.mktemp("partial")
    cfg = small_config(
        root,
        run=RUN,
        iterations=3,
        pipeline={"max_staleness": 2, "partial_rollout": True},
        data={"prompts_per_rollout": PROMPTS, "eval_prompts": PROMPTS},
        rollout={"n_samples_per_prompt": N, "function": "tests.partial_fixtures:held_at_sync"},
        # One sample per forward makes a train step ~10x longer than generating a rollout of this model, so the
        # abort lands after the next rollout's other groups (and continuations) are done: only the held group
        # is cut. With larger micro-batches the train step takes about as long as a generation.
        train={"micro_batch_size": 1},
    )
    summary = rl_train(cfg)
    assert summary["iterations"] == 3
    metrics = [json.loads(line) for line in (root / RUN / "metrics.jsonl").read_text().splitlines()]
    return root, metrics


def test_abort_at_sync_keeps_the_cut_group_out_of_training(partial_run):
    root, metrics = partial_run
    # the flow's abort branch ran in iteration 1 (rollout 0 trained, rollout 1 in flight)
    tasks = task_names_by_flow_run(f"{RUN}/iter-")
    assert "abort-generation" in tasks[f"{RUN}/iter-0000"], tasks
    rows = rows_of(root, RUN, 1)
    assert len(rows) == PROMPTS * N
    held = [r for r in rows if r["group_index"] == HELD_GROUP]
    aborted = [r for r in held if r["status"] == "aborted"]
    assert aborted, [(r["status"], r["response_length"], r["metadata"]) for r in held]
    # cut after its first token: the token and its log-prob are kept, from weights 0
    for r in aborted:
        assert r["response_length"] == 1 and len(r["rollout_log_probs"]) == 1 and r["weight_version"] == 0
    assert all(r["metadata"].get("filtered") == "aborted" for r in held)  # the whole group is deferred
    assert all(not r["metadata"].get("filtered") for r in rows if r["group_index"] != HELD_GROUP)
    assert all(r["status"] in ("completed", "truncated") for r in rows if r["group_index"] != HELD_GROUP)
    # iteration 2 trained rollout 1 without the deferred group
    assert metrics[1]["rollout_id"] == 1
    assert metrics[1]["train/n_samples"] == (PROMPTS - 1) * N
    assert metrics[1]["pipeline/filtered_groups_aborted"] == 1.0


def test_next_rollout_continues_the_cut_samples_under_new_weights(partial_run):
    root, metrics = partial_run
    cut = {r["index"]: r for r in rows_of(root, RUN, 1) if r["status"] == "aborted"}
    assert cut
    rows = rows_of(root, RUN, 2)
    continued = [r for r in rows if r["metadata"].get("continued_from")]
    assert sorted(r["metadata"]["continued_from"]["index"] for r in continued) == sorted(cut)
    for r in continued:
        assert r["metadata"]["continued_from"]["rollout_id"] == 1
        old = cut[r["metadata"]["continued_from"]["index"]]
        k = old["response_length"]
        assert r["tokens"][: len(old["tokens"])] == old["tokens"]  # kept tokens, then new ones
        assert r["rollout_log_probs"][:k] == old["rollout_log_probs"]
        assert r["response_length"] > k and r["status"] in ("completed", "truncated")
        # rollout 2 is generated while weights 1 are on the engine: the kept token is v0, the rest v1
        assert r["metadata"]["weight_versions"] == [0] * k + [1] * (r["response_length"] - k)
        assert r["weight_version"] == 1
        assert not r["metadata"].get("filtered")  # trained in iteration 3
    # the continued group comes back whole (its unfinished samples continued, the others as they were)
    groups = {r["group_index"] for r in continued}
    assert len(groups) == 1 and sum(r["group_index"] in groups for r in rows) == N
    row = metrics[2]
    assert row["rollout_id"] == 2
    assert row["pipeline/continued_samples"] == len(continued)
    assert row["train/n_samples"] == len(trained(rows))
    # trainer version 2 trained tokens generated with weights 0
    assert row["pipeline/staleness_max"] == 2.0 and row["pipeline/oldest_weight_version"] == 0.0


def test_show_prints_the_per_token_versions_of_a_continued_sample(partial_run):
    from typer.testing import CliRunner

    from rollflow.flows.cli import app

    root, _ = partial_run
    continued = [r for r in rows_of(root, RUN, 2) if r["metadata"].get("continued_from")]
    assert continued
    res = CliRunner().invoke(
        app, ["show", str(root / RUN), "--id", "2", "--limit", "100", "--max-chars", "200"], env={"COLUMNS": "400"}
    )
    assert res.exit_code == 0, res.output
    for r in continued:
        expected = version_runs(r["metadata"]["weight_versions"])
        assert expected.startswith("v0x") and "+v1x" in expected
        assert expected in res.output, (expected, res.output[-3000:])
    # every other sample has one version, shown without a '+'
    assert res.output.count("+v") == len(continued), res.output[-3000:]


def test_replay_of_the_async_run_trains_exactly_its_trained_rows(partial_run, tmp_path):
    from rollflow.flows.debug import replay_train

    root, metrics = partial_run
    cfg = small_config(
        root,
        run=f"{RUN}-replay",
        data={"prompts_per_rollout": PROMPTS, "eval_prompts": PROMPTS},
        rollout={"n_samples_per_prompt": N},
        train={"micro_batch_size": 32},
        debug={"train_only": True},
        store={"root": str(root), "results": str(tmp_path / "results")},
    )
    out = replay_train(cfg, rollout_ids=[1, 2], source_run=RUN, use_cache=False)
    steps = out["steps"]
    assert [s["rollout_id"] for s in steps] == [1, 2] and not any(s["cached"] for s in steps)
    for step in steps:
        rows = trained(rows_of(root, RUN, step["rollout_id"]))
        assert step["train/n_samples"] == len(rows) == metrics[step["rollout_id"]]["train/n_samples"]
        mean_reward = sum(r["reward"] for r in rows) / len(rows)
        assert step["rollout/raw_reward"] == pytest.approx(mean_reward, abs=1e-9)
        assert step["rollout/raw_reward"] == pytest.approx(metrics[step["rollout_id"]]["rollout/raw_reward"], abs=1e-9)
    assert out["optimizer_steps"] and out["final_state"]
