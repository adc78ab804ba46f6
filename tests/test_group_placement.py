"""The run's actors inside its placement group (fake GPUs: the `fake_gpu` custom resource of
`ray_local`), and the colocation memory sequence of `rl_iteration` (placement=colocate, offload=true).

The recording workers (tests/drill_workers.py) log, from inside the actors, the placement group they
run in and every colocation call, in order, to a file per run.
"""

from __future__ import annotations

import uuid

import pytest

from tests.conftest import small_config
from tests.test_placement import _wait_use

FAKE = "fake_gpu"


def _use_recording_workers(monkeypatch):
    import rollflow.flows.group as group_module
    from tests.drill_workers import RecordingRolloutWorker, RecordingTrainWorker

    # the names rollflow.flows.group starts its actors from: the actors (and restarts) are the recording ones.
    monkeypatch.setattr(group_module, "RolloutWorker", RecordingRolloutWorker)
    monkeypatch.setattr(group_module, "TrainWorker", RecordingTrainWorker)


def _calls(run: str) -> list[str]:
    from tests.drill_workers import calls_file

    path = calls_file(run)
    return path.read_text().splitlines() if path.exists() else []


def _starts(run: str) -> list[dict[str, str]]:
    return _starts_from(_calls(run))


def test_group_start_puts_actors_in_their_bundles_and_restarts_in_the_same(tmp_path, ray_local, monkeypatch):
    import ray

    from rollflow.flows.group import ENGINE, WorkerGroup
    from rollflow.infra.workers import stop_actor
    from tests.drill_workers import calls_file

    _use_recording_workers(monkeypatch)
    run = f"pg-{uuid.uuid4().hex[:8]}"
    # disaggregated: trainer 1 + engines 1 x 2 = 3 bundles (budget 4): trainer on 0, engine on 1 (+2 for its TP)
    cfg = small_config(
        tmp_path,
        run=run,
        resources={"num_gpus": 4, "trainer_gpus": 1, "num_engines": 1, "gpus_per_engine": 2, "gpu_resource": FAKE},
    )
    group = WorkerGroup.for_run(cfg)
    assert group.plan is not None and group.plan.needed == 3  # computed once, held by the group
    pg = group.start_placement()
    try:
        assert pg is not None and ray.util.placement_group_table(pg)["bundles"] == {i: {FAKE: 1.0} for i in range(3)}
        group.start_trainer(None)
        group.start_engine(None)
        expected = {0: 1.0, 1: 1.0, 2: 0.0}
        assert _wait_use(pg, expected) == expected
        starts = _starts(run)
        assert [s["role"] for s in starts] == ["trainer", "engine"]
        assert {s["pg"] for s in starts} == {pg.id.hex()}
        # the in-process hf engine uses the GPU Ray gives its actor (SGLang engines: tests/test_sglang_ray.py)
        assert starts[1]["base_gpu_id"] == "None"

        # A task retry after the engine died restarts it in the same bundle.
        stop_actor(run, ENGINE)
        assert _wait_use(pg, {0: 1.0, 1: 0.0, 2: 0.0}) == {0: 1.0, 1: 0.0, 2: 0.0}
        group.ensure_engine(0)
        assert _wait_use(pg, expected) == expected
        restarted = _starts(run)[-1]
        assert restarted["role"] == "engine" and restarted["pg"] == pg.id.hex() and restarted["pid"] != starts[1]["pid"]
    finally:
        group.stop_all()
        calls_file(run).unlink(missing_ok=True)
    assert group.placement_group() is None  # released with the actors
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"


@pytest.mark.parametrize("critic_gpus, expected", [(0, {0: 1.0, 1: 1.0}), (1, {0: 1.0, 1: 1.0, 2: 1.0})])
def test_ppo_critic_actor_runs_in_its_bundle(tmp_path, ray_local, critic_gpus, expected):
    """ppo on GPUs: the critic takes 0.4 of trainer rank 0's GPU (beside the trainer's 0.6) or a bundle of its
    own after the engine's, as Ray's own resource accounting of the placement group shows."""
    from rollflow.flows.group import WorkerGroup

    run = f"pgc-{uuid.uuid4().hex[:8]}"
    cfg = small_config(
        tmp_path,
        run=run,
        algo={"advantage_estimator": "ppo"},
        resources={
            "num_gpus": 3,
            "trainer_gpus": 1,
            "num_engines": 1,
            "gpus_per_engine": 1,
            "critic_gpus": critic_gpus,
            "gpu_resource": FAKE,
        },
    )
    group = WorkerGroup.for_run(cfg)
    pg = group.start_placement()
    try:
        group.start_trainer(None)
        group.start_critic(None).wait_started()
        group.start_engine(None)
        assert _wait_use(pg, expected) == expected
    finally:
        group.stop_all()
    assert group.placement_group() is None


def test_cpu_default_has_no_placement_group(tmp_path):
    from rollflow.flows.group import WorkerGroup, uses_placement

    cfg = small_config(tmp_path)
    assert not uses_placement(cfg)
    # nothing touches Ray on CPU: these answer without a cluster
    group = WorkerGroup.for_run(cfg)
    assert group.plan is None
    assert group.start_placement() is None and group.placement_options("engine") == {}
    assert group.engine_base_gpu_id() is None and group.engine_gpu_ids() is None


@pytest.mark.parametrize("fake_gpus", [False, True], ids=["cpu", "fake-gpus"])
def test_colocate_offload_sequence(fake_gpus, tmp_path, prefect_api, ray_local, monkeypatch):
    from rollflow.flows.group import WorkerGroup
    from rollflow.flows.reporting import read_metrics
    from rollflow.flows.train import rl_train
    from tests.drill_workers import calls_file

    _use_recording_workers(monkeypatch)
    run = f"colo-{uuid.uuid4().hex[:8]}"
    resources = (
        {"num_gpus": 1, "trainer_gpus": 1, "num_engines": 1, "gpus_per_engine": 1, "gpu_resource": FAKE}
        if fake_gpus
        else {}
    )
    cfg = small_config(
        tmp_path,
        run=run,
        iterations=1,
        placement="colocate",
        offload=True,
        resources=resources,
        data={"prompts_per_rollout": 8},
        eval_every=0,
    )
    try:
        rl_train(cfg)
        calls = _calls(run)
    finally:
        calls_file(run).unlink(missing_ok=True)
    steps = [c for c in calls if not c.startswith("start ")]
    # SGLang's colocation order, with the trainer's state on the host while the engine generates
    assert steps == [
        "release",
        "trainer onload",
        "train",
        "resume weights",
        "update 1",
        "trainer offload",
        "resume kv_cache",
    ], calls
    starts = _starts_from(calls)
    if fake_gpus:
        # trainer and engine share the one bundle of the run's placement group
        assert [s["role"] for s in starts] == ["trainer", "engine"] and len({s["pg"] for s in starts}) == 1
        assert starts[0]["pg"] != "none"
        assert WorkerGroup.for_run(cfg).placement_group() is None  # removed at the end of the flow
    else:
        assert {s["pg"] for s in starts} == {"none"}
    rows = read_metrics(cfg)
    assert rows[-1]["sync/parity_ok"] == 1.0 and rows[-1]["sync/weight_version"] == 1


def _starts_from(calls: list[str]) -> list[dict[str, str]]:
    out = []
    for line in calls:
        if line.startswith("start "):
            _, role, *fields = line.split()
            out.append({"role": role, **dict(f.split("=", 1) for f in fields)})
    return out


@pytest.mark.slow
def test_two_data_parallel_trainer_ranks_train_through_the_flow(tmp_path, prefect_api, ray_local):
    """resources.trainer_gpus=2: two trainer actors (one per bundle) train every step together (gloo on
    CPU) and hold identical weights; rank 0 serves the sync, whose parity must hold."""
    from rollflow.flows.group import WorkerGroup
    from rollflow.flows.reporting import read_metrics
    from rollflow.flows.train import rl_train

    run = f"dp-{uuid.uuid4().hex[:8]}"
    cfg = small_config(
        tmp_path,
        run=run,
        iterations=1,
        eval_every=0,
        data={"prompts_per_rollout": 8},
        placement="colocate",
        resources={"num_gpus": 2, "trainer_gpus": 2, "num_engines": 1, "gpus_per_engine": 2, "gpu_resource": FAKE},
        train={"num_steps_per_rollout": 2},
    )
    rl_train(cfg)
    rows = read_metrics(cfg)
    assert rows[-1]["sync/parity_ok"] == 1.0 and rows[-1]["train/n_samples"] == 32
    # both ranks hold the same weights after the step (checked on a fresh start from the checkpoint)
    group = WorkerGroup.for_run(cfg)
    try:
        group.start_placement()
        trainer = group.start_trainer(1)
        assert trainer.world_size == 2 and group.trainer().world_size == 2
        sums = [trainer.weight_checksums(rank=r) for r in range(2)]
        assert sums[0] == sums[1]
        assert trainer.describe(rank=1).world_size == 2
    finally:
        group.stop_all()
