"""End to end through a real Prefect API and a real local Ray: the walking skeleton's contract."""

from __future__ import annotations

import pytest

from rollflow.artifacts import ArtifactCorrupt, RolloutStore
from tests.conftest import small_config, watching_syncs

pytestmark = pytest.mark.slow


def test_two_iterations_step1_exact_and_synced(tmp_path, prefect_api, ray_local):
    from prefect import get_client

    from rollflow.flows.reporting import read_metrics
    from rollflow.flows.train import rl_train

    cfg = small_config(tmp_path, run="e2e", iterations=2)
    summary = rl_train(cfg)
    assert summary["iterations"] == 2
    rows = read_metrics(cfg)
    first = rows[0]
    # Step 1: old and reference log-probs come from the same forward -> exactly equal.
    assert first["rollout/log_probs_equal_ref"] == 1.0
    assert first["rollout/kl"] == 0.0
    assert first["rollout/log_probs"] == first["rollout/ref_log_probs"]
    assert first["train/ppo_kl"] == 0.0
    assert first["train/pg_clipfrac"] == 0.0
    # Iteration 2 trains a policy that moved: no longer equal to the reference.
    assert rows[1]["rollout/log_probs_equal_ref"] == 0.0
    for row in rows:
        assert row["sync/parity_ok"] == 1.0
        assert row["sync/weight_version"] == row["iteration"]
        # Engine log-probs agree with the trainer's teacher-forced ones to fp32 noise.
        assert row["train/train_rollout_logprob_abs_diff"] < 1e-3

    store = RolloutStore(str(tmp_path))
    assert store.list_ids("e2e", "train") == [0, 1]
    art = store.load("e2e", "train", 1)
    assert len(art.samples) == 32 * 4
    assert {s.weight_version for s in art.samples} == {1}
    assert (tmp_path / "e2e" / "reward_curve.png").stat().st_size > 1000

    # The payload is tamper-evident: flip one byte, loading names the file and the checksum.
    payload = tmp_path / "e2e" / "rollouts" / "train" / "000000" / "samples.parquet"
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF
    payload.write_bytes(bytes(data))
    with pytest.raises(ArtifactCorrupt) as err:
        store.load("e2e", "train", 0)
    assert "samples.parquet" in str(err.value) and "checksum" in str(err.value)

    # The Prefect API saw one rl_train run with one rl_iteration sub-flow run per iteration.
    import anyio

    async def flow_names():
        async with get_client() as client:
            runs = await client.read_flow_runs()
            flows = {f.id: f.name for f in await client.read_flows()}
            return sorted(flows[r.flow_id] for r in runs if r.state and r.state.is_completed())

    names = anyio.run(flow_names)
    assert names.count("rl_iteration") >= 2 and "rl_train" in names

    # Each iteration's sub-flow run beats through rollflow's own thread (what crash detection reads) and has no
    # heartbeat thread of Prefect's: joining that one at the end of every sub-flow cost ~0.9 s an iteration.
    import time

    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as client:
        iterations = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["rl_iteration"])))
        ids = [f"prefect.flow-run.{r.id}" for r in iterations if r.name.startswith("e2e/")]
        assert len(ids) == 2, [r.name for r in iterations]
        heartbeat_events = ["rollflow.flow-run.heartbeat", "prefect.flow-run.heartbeat"]
        body = {"filter": {"resource": {"id": ids}, "event": {"name": heartbeat_events}}, "limit": 50}
        deadline = time.monotonic() + 30
        while True:  # the server persists events in batches
            events = client.request("POST", "/events/filter", json=body).json()["events"]
            beats = {(e["resource"]["prefect.resource.id"], e["event"]) for e in events}
            if {(i, "rollflow.flow-run.heartbeat") for i in ids} <= beats or time.monotonic() > deadline:
                break
            time.sleep(1)
    assert beats == {(i, "rollflow.flow-run.heartbeat") for i in ids}, sorted(beats)


# The SIGKILL-and-resume drill (file:// and s3://) lives in tests/test_fault_drills.py (drill 2).


def test_the_hf_engine_takes_the_trainers_buckets_from_the_rank_on_its_gpu(tmp_path, prefect_api, ray_local):
    """rollout.hf_weight_sync=tensor under placement=colocate, on Ray-only GPUs (no CUDA behind them: the CPU tensors
    travel by value through the code that sends CUDA IPC handles on a real GPU): the sync goes bucket by bucket
    from the trainer rank on the engine's GPU, and parity holds after it."""
    from rollflow.flows.group import WorkerGroup
    from rollflow.flows.reporting import read_metrics
    from rollflow.flows.train import rl_train

    cfg = small_config(
        tmp_path,
        run="hf-tensor",
        iterations=1,
        eval_every=0,
        placement="colocate",
        offload=True,
        resources={"num_gpus": 1, "trainer_gpus": 1, "num_engines": 1, "gpus_per_engine": 1},
        rollout={"hf_weight_sync": "tensor"},
        train={"lr": 1e-2},
    )
    seen: list[dict] = []

    def observe(cfg_, out):
        group = WorkerGroup.for_run(cfg_)
        seen.append({"out": out, "engine_gpu": group.engine().visible_gpu(), "trainer": group.trainer().gpu_ids()})

    with watching_syncs(observe):
        rl_train(cfg)
    rows = read_metrics(cfg)
    assert [r["sync/weight_version"] for r in rows] == [1] and rows[0]["sync/parity_ok"] == 1.0
    assert rows[0]["train/grad_norm"] > 0  # the step moved the policy: parity compared new weights
    assert len(seen) == 1
    for sync in seen:
        assert sync["out"]["sync_mode"] == "tensor" and sync["out"]["sync_buckets"] >= 1
        assert sync["engine_gpu"] is not None and sync["trainer"] == [sync["engine_gpu"]]
        assert sync["out"]["sync_sources"] == [0]
