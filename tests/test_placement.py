"""GPU placement: the pure bundle layout, config-time budget errors, and real Ray placement groups on a
local cluster whose GPUs are the custom resource `fake_gpu` (8 of them, declared by the `ray_local`
fixture in conftest.py)."""

from __future__ import annotations

import time

import pytest

from rollflow.infra.placement import (
    PlacementError,
    ResourcesConfig,
    actor_options,
    bundle_nodes,
    check_cluster,
    create_placement_group,
    plan_placement,
    ranks_per_node,
)

FAKE = "fake_gpu"


def res(**kw) -> ResourcesConfig:
    return ResourcesConfig(gpu_resource=FAKE, **kw)


def test_disaggregated_layout():
    plan = plan_placement("disaggregated", res(num_gpus=8, trainer_gpus=4, num_engines=2, gpus_per_engine=2))
    assert plan.bundles == [{FAKE: 1}] * 8
    assert plan.trainer_bundles == [0, 1, 2, 3]
    assert plan.engine_bundles == [[4, 5], [6, 7]]
    assert plan.gpu_fractions == {"trainer": 1.0, "engine": 1.0}
    assert plan.arithmetic == "disaggregated needs trainer 4 + engines 2 x 2 = 8 GPUs, cluster has 8"


def test_colocate_layout_shares_bundles():
    plan = plan_placement(
        "colocate", res(num_gpus=4, trainer_gpus=4, num_engines=2, gpus_per_engine=2, cpus_per_bundle=1)
    )
    assert plan.bundles == [{FAKE: 1, "CPU": 1}] * 4
    assert plan.trainer_bundles == [0, 1, 2, 3] and plan.engine_bundles == [[0, 1], [2, 3]]
    assert plan.gpu_fractions["trainer"] + plan.gpu_fractions["engine"] <= 1
    assert plan.actor_bundle("engine", 1) == 2


def test_ppo_critic_gets_its_own_bundle_or_a_share_of_trainer_gpu_0():
    # its own GPU: disaggregated trainer 2 + engines 1 x 2 = bundles 0-3, the critic on bundle 4
    own = plan_placement(
        "disaggregated", res(num_gpus=5, trainer_gpus=2, num_engines=1, gpus_per_engine=2, critic_gpus=1), critic=True
    )
    assert (own.needed, len(own.bundles), own.actor_bundle("critic")) == (5, 5, 4)
    assert own.gpu_fractions["critic"] == 1.0 and own.gpu_fractions["trainer"] == 1.0
    with pytest.raises(PlacementError, match=r"critic 1 = 5 GPUs, cluster has 4"):
        plan_placement(
            "disaggregated",
            res(num_gpus=4, trainer_gpus=2, num_engines=1, gpus_per_engine=2, critic_gpus=1),
            critic=True,
        )
    # a share of trainer rank 0's GPU: no extra bundle, the two fractions fit one GPU
    shared = plan_placement(
        "disaggregated", res(num_gpus=4, trainer_gpus=2, num_engines=1, gpus_per_engine=2), critic=True
    )
    assert (shared.needed, shared.actor_bundle("critic"), shared.actor_bundle("trainer")) == (4, 0, 0)
    assert shared.gpu_fractions["trainer"] + shared.gpu_fractions["critic"] == pytest.approx(1.0)
    coloc = plan_placement("colocate", res(num_gpus=2, trainer_gpus=2, num_engines=1, gpus_per_engine=2), critic=True)
    fr = coloc.gpu_fractions
    assert coloc.actor_bundle("critic") == 0 and fr["trainer"] + fr["engine"] + fr["critic"] <= 1.0
    # replay (no engines) of a colocated ppo run: trainer and critic split the GPU
    replay = plan_placement(
        "colocate", res(num_gpus=2, trainer_gpus=2, num_engines=1, gpus_per_engine=2), rollout=False, critic=True
    )
    assert replay.gpu_fractions["trainer"] + replay.gpu_fractions["critic"] <= 1.0
    with pytest.raises(PlacementError, match="trainer_gpus=0"):
        plan_placement("disaggregated", res(num_gpus=2, num_engines=1, gpus_per_engine=2), critic=True)
    # without a critic nothing changes, and a plan without one has no critic role
    plain = plan_placement("disaggregated", res(num_gpus=4, trainer_gpus=2, num_engines=1, gpus_per_engine=2))
    assert plain.gpu_fractions == {"trainer": 1.0, "engine": 1.0}
    with pytest.raises(ValueError, match="critic"):
        plain.actor_bundle("critic")


def test_over_budget_shows_the_arithmetic():
    with pytest.raises(PlacementError) as err:
        plan_placement("disaggregated", res(num_gpus=6, trainer_gpus=4, num_engines=2, gpus_per_engine=2))
    assert str(err.value) == (
        "disaggregated needs trainer 4 + engines 2 x 2 = 8 GPUs, cluster has 6 (resources.num_gpus)"
    )
    with pytest.raises(PlacementError, match=r"engines 3 x 2 = 6 GPUs must equal trainer 4 GPUs"):
        plan_placement("colocate", res(num_gpus=8, trainer_gpus=4, num_engines=3, gpus_per_engine=2))
    with pytest.raises(
        PlacementError,
        match=r"colocate needs trainer 8 GPUs shared with engines 4 x 2 = 8 GPUs "
        r"= 8 GPUs, cluster has 4",
    ):
        plan_placement("colocate", res(num_gpus=4, trainer_gpus=8, num_engines=4, gpus_per_engine=2))


def test_cpu_default_and_one_sided_runs():
    assert plan_placement("disaggregated", ResourcesConfig()).empty
    rollout_only = plan_placement(
        "disaggregated", res(num_gpus=4, trainer_gpus=4, num_engines=2, gpus_per_engine=2), train=False
    )
    assert (
        rollout_only.needed == 4
        and rollout_only.trainer_bundles == []
        and rollout_only.engine_bundles == [[0, 1], [2, 3]]
    )
    assert rollout_only.arithmetic == "disaggregated needs engines 2 x 2 = 4 GPUs, cluster has 4"


def test_budget_is_checked_at_config_time():
    from rollflow.flows.config import RunConfig
    from rollflow.flows.config_loading import ConfigError, load_config

    assert RunConfig().resources.num_gpus == 0  # CPU default unchanged
    with pytest.raises(ConfigError, match=r"disaggregated needs trainer 4 \+ engines 2 x 2 = 8 GPUs, cluster has 6"):
        load_config(
            None,
            [
                "resources.num_gpus=6",
                "resources.trainer_gpus=4",
                "resources.num_engines=2",
                "resources.gpus_per_engine=2",
            ],
        )
    with pytest.raises(ConfigError, match="rollout.sglang.tp_size=4 differs from resources.gpus_per_engine=2"):
        load_config(
            None,
            [
                "rollout.engine=sglang",
                "rollout.sglang.tp_size=4",
                "resources.num_gpus=8",
                "resources.trainer_gpus=4",
                "resources.num_engines=2",
                "resources.gpus_per_engine=2",
            ],
        )
    cfg = load_config(
        None,
        [
            "rollout.engine=sglang",
            "debug.rollout_only=true",
            "resources.num_gpus=4",
            "resources.trainer_gpus=8",
            "resources.num_engines=2",
            "resources.gpus_per_engine=2",
        ],
    )
    assert cfg.debug.rollout_only  # no trainer: its 8 GPUs are not counted
    # the in-process hf engine cannot be several engines
    with pytest.raises(
        ConfigError, match=r"resources.num_engines=2 with rollout.engine='hf'.*use rollout.engine='sglang'"
    ):
        load_config(None, ["resources.num_engines=2"])


def _bundle_use(pg) -> dict[int, float]:
    """GPU in use per bundle, from Ray's per-bundle resources (`fake_gpu_group_<i>_<pg id>`)."""
    import ray

    hexid = pg.id.hex()
    avail = ray.available_resources()
    out = {}
    for i in range(len(pg.bundle_specs)):
        out[i] = round(1.0 - avail.get(f"{FAKE}_group_{i}_{hexid}", 0.0), 3)
    return out


def _wait_use(pg, expected: dict[int, float], timeout: float = 15.0) -> dict[int, float]:
    deadline = time.monotonic() + timeout
    while True:
        use = _bundle_use(pg)
        if use == expected or time.monotonic() > deadline:
            return use
        time.sleep(0.2)


def _probe_cls():
    import ray

    @ray.remote(num_cpus=0)
    class Probe:
        def ping(self) -> bool:
            return True

    return Probe


def test_placement_groups_on_fake_gpus(ray_local):
    import ray

    Probe = _probe_cls()
    # disaggregated: trainer 2 + engines 3 x 2 = 8 bundles, each actor on its own first bundle
    plan = plan_placement("disaggregated", res(num_gpus=8, trainer_gpus=2, num_engines=3, gpus_per_engine=2))
    pg = create_placement_group(plan, gpu_resource=FAKE, timeout_s=30)
    try:
        table = ray.util.placement_group_table(pg)
        assert table["strategy"] == "PACK" and table["bundles"] == {i: {FAKE: 1.0} for i in range(8)}
        actors = [Probe.options(**actor_options(plan, pg, "trainer", i, gpu_resource=FAKE)).remote() for i in range(2)]
        actors += [Probe.options(**actor_options(plan, pg, "engine", k, gpu_resource=FAKE)).remote() for k in range(3)]
        assert ray.get([a.ping.remote() for a in actors], timeout=60) == [True] * 5
        expected = {0: 1.0, 1: 1.0, 2: 1.0, 3: 0.0, 4: 1.0, 5: 0.0, 6: 1.0, 7: 0.0}
        assert _wait_use(pg, expected) == expected  # engines on bundles 2, 4, 6; 3, 5, 7 reserved for their TP
        for a in actors:
            ray.kill(a)
    finally:
        ray.util.remove_placement_group(pg)

    # colocate: trainer 4 and engines 2 x 2 share 4 bundles (0.4 + 0.2 of a GPU where both sit)
    plan = plan_placement("colocate", res(num_gpus=8, trainer_gpus=4, num_engines=2, gpus_per_engine=2))
    pg = create_placement_group(plan, gpu_resource=FAKE, timeout_s=30)
    try:
        assert ray.util.placement_group_table(pg)["bundles"] == {i: {FAKE: 1.0} for i in range(4)}
        actors = [Probe.options(**actor_options(plan, pg, "trainer", i, gpu_resource=FAKE)).remote() for i in range(4)]
        actors += [Probe.options(**actor_options(plan, pg, "engine", k, gpu_resource=FAKE)).remote() for k in range(2)]
        assert ray.get([a.ping.remote() for a in actors], timeout=60) == [True] * 6
        expected = {0: 0.6, 1: 0.4, 2: 0.6, 3: 0.4}
        assert _wait_use(pg, expected) == expected
        # one node: every bundle is on it, so the 4 trainer ranks share its host memory
        here = ray.get_runtime_context().get_node_id()
        assert bundle_nodes(pg) == {i: here for i in range(4)}
        assert ranks_per_node(bundle_nodes(pg), plan.trainer_bundles) == [4, 4, 4, 4]
        for a in actors:
            ray.kill(a)
    finally:
        ray.util.remove_placement_group(pg)


def test_over_budget_against_the_ray_cluster(ray_local):
    import ray

    # the config claims 10 GPUs; the Ray cluster has 8 fake ones: refused before anything is reserved
    plan = plan_placement("disaggregated", res(num_gpus=10, trainer_gpus=4, num_engines=3, gpus_per_engine=2))
    with pytest.raises(PlacementError) as err:
        create_placement_group(plan, gpu_resource=FAKE)
    assert str(err.value) == "disaggregated needs trainer 4 + engines 3 x 2 = 10 GPUs, Ray cluster has 8 fake_gpu"
    check_cluster(
        plan_placement("colocate", res(num_gpus=8, trainer_gpus=8, num_engines=4, gpus_per_engine=2)),
        ray.cluster_resources(),
        FAKE,
    )
    assert actor_options(plan_placement("disaggregated", ResourcesConfig()), None, "engine") == {}


def test_ranks_per_node_counts_the_ranks_whose_bundles_share_a_node():
    nodes = {0: "a", 1: "b", 2: "a", 3: "a", 4: "c"}
    assert ranks_per_node(nodes, [0, 1, 2, 3]) == [3, 1, 3, 3]
    assert ranks_per_node(nodes, [1, 4]) == [1, 1]
    assert ranks_per_node({0: "a"}, [0, 5, 6]) == [1, 1, 1]  # bundles Ray has not placed: a node each
