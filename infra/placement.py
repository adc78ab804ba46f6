"""GPU placement of the run's trainer and engines: a pure layout, validated at config time, and the
Ray placement group that reserves it.

One bundle per GPU (`{gpu_resource: 1}` plus `cpus_per_bundle` CPUs), packed:

- disaggregated: trainer bundles [0, T), then engine k owns [T + k*G, T + (k+1)*G); total T + E*G;
- colocate: trainer and engines share the same T bundles (engine k owns [k*G, (k+1)*G)); needs
  E*G == T, each engine GPU being one trainer GPU; actors take a fraction of their bundle's GPU
  (trainer 0.4, engine 0.2, as slime does) so both fit.

A ppo run's critic (one process, torch) gets its own bundle after the engines with
`resources.critic_gpus=1`, or shares trainer rank 0's GPU with `critic_gpus=0` (the default): its
fraction then comes out of that bundle (colocate: 0.2 of the 1 - 0.4 - 0.2 left; disaggregated: the
trainer's 1.0 becomes 0.6 + 0.4). Ray's fractions only schedule; memory is shared as in colocate.

An engine with G > 1 GPUs runs one actor on its first bundle; its SGLang server drives all G GPUs
(tensor parallel, `--base-gpu-id` = the first bundle's GPU), which the other G-1 bundles reserve.
With zero GPUs (the CPU default) there is no placement group and nothing changes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollflow.tasks.net import free_port, node_ip

Placement = Literal["colocate", "disaggregated"]
COLOCATE_FRACTIONS = {"trainer": 0.4, "engine": 0.2}
SHARED_CRITIC_FRACTIONS = {"colocate": {"critic": 0.2}, "disaggregated": {"trainer": 0.6, "critic": 0.4}}


class ResourcesConfig(BaseModel):
    """GPUs of the run (all 0 = CPU: no placement group, nothing reserved)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    num_gpus: int = Field(0, ge=0, description="GPUs the Ray cluster has for this run (the budget)")
    trainer_gpus: int = Field(0, ge=0, description="GPUs of the trainer (actor) ranks")
    num_engines: int = Field(1, ge=1, description="rollout engines (SGLang servers)")
    gpus_per_engine: int = Field(0, ge=0, description="GPUs per engine (its tensor parallel size)")
    gpu_resource: str = Field("GPU", description="Ray resource that counts GPUs (tests use a custom one)")
    cpus_per_bundle: float = Field(0, ge=0, description="CPUs reserved with each GPU bundle")
    critic_gpus: int = Field(
        0,
        ge=0,
        le=1,
        description="ppo's critic: 1 = a GPU of its own (a bundle after the engines), 0 = a share of "
        "trainer rank 0's GPU",
    )

    @property
    def uses_gpus(self) -> bool:
        return bool(self.num_gpus or self.trainer_gpus or self.gpus_per_engine)


class PlacementError(ValueError):
    """A GPU budget that does not add up; the message shows the arithmetic."""


@dataclasses.dataclass(frozen=True)
class PlacementPlan:
    placement: str
    bundles: list[dict[str, float]]
    trainer_bundles: list[int]
    engine_bundles: list[list[int]]  # per engine, its bundle indices (first = where its actor runs)
    gpu_fractions: dict[str, float]  # GPU each actor requests from its bundle
    needed: int
    arithmetic: str
    critic_bundle: int | None = None  # ppo's critic actor (None: no critic)

    @property
    def empty(self) -> bool:
        return not self.bundles

    def actor_bundle(self, role: str, index: int = 0) -> int:
        if role == "trainer":
            return self.trainer_bundles[index]
        if role == "engine":
            return self.engine_bundles[index][0]
        if role == "critic" and self.critic_bundle is not None:
            return self.critic_bundle
        raise ValueError(f"unknown role {role!r} in this plan: trainer, engine (or critic in a ppo run's plan)")


def plan_placement(
    placement: Placement, res: ResourcesConfig, *, train: bool = True, rollout: bool = True, critic: bool = False
) -> PlacementPlan:
    """The bundle layout for `placement`; raises PlacementError (with the arithmetic) when it does not fit.

    `train` / `rollout` = whether the run has a trainer / engines (rollout-only and replay runs
    have one side only); `critic` = whether a ppo critic runs beside the trainer.
    """
    critic = critic and train
    T = res.trainer_gpus if train else 0
    E, G = (res.num_engines, res.gpus_per_engine) if rollout else (0, 0)
    if not res.uses_gpus:
        return PlacementPlan(placement, [], [], [], {}, 0, "CPU run: no GPUs")
    if rollout and G == 0 and T > 0:
        raise PlacementError(
            f"resources.gpus_per_engine=0 with trainer_gpus={T}: engines need GPUs too (set resources.gpus_per_engine)"
        )
    engines = E * G
    if placement == "colocate" and train and rollout:
        if engines != T:
            raise PlacementError(
                f"colocate shares each GPU between a trainer rank and an engine: engines {E} x {G} = {engines} GPUs "
                f"must equal trainer {T} GPUs"
            )
        needed = T
        arithmetic = f"colocate needs trainer {T} GPUs shared with engines {E} x {G} = {engines} GPUs = {needed} GPUs"
        trainer = list(range(T))
        engine = [list(range(k * G, (k + 1) * G)) for k in range(E)]
        fractions = dict(COLOCATE_FRACTIONS)
    else:
        needed = T + engines
        parts = ([f"trainer {T}"] if train else []) + ([f"engines {E} x {G}"] if rollout else [])
        arithmetic = f"{placement} needs {' + '.join(parts)} = {needed} GPUs"
        trainer = list(range(T))
        engine = [list(range(T + k * G, T + (k + 1) * G)) for k in range(E)]
        fractions = {"trainer": 1.0, "engine": 1.0}
    critic_bundle = None
    if critic and res.critic_gpus:
        critic_bundle = needed
        needed += 1
        arithmetic += f" + critic 1 = {needed} GPUs"
        fractions["critic"] = 1.0
    elif critic:
        if T == 0:
            raise PlacementError(
                "resources.critic_gpus=0 puts ppo's critic on trainer rank 0's GPU, but resources.trainer_gpus=0: "
                "set resources.trainer_gpus >= 1 or resources.critic_gpus=1"
            )
        critic_bundle = trainer[0]
        shared_with_engines = placement == "colocate" and rollout
        fractions.update(SHARED_CRITIC_FRACTIONS["colocate" if shared_with_engines else "disaggregated"])
        arithmetic += f" (critic shares trainer GPU 0: {fractions['critic']:g} of it)"
    if needed > res.num_gpus:
        raise PlacementError(f"{arithmetic}, cluster has {res.num_gpus} (resources.num_gpus)")
    bundle: dict[str, float] = {res.gpu_resource: 1}
    if res.cpus_per_bundle:
        bundle["CPU"] = res.cpus_per_bundle
    return PlacementPlan(
        placement,
        [dict(bundle) for _ in range(needed)],
        trainer,
        engine,
        fractions,
        needed,
        f"{arithmetic}, cluster has {res.num_gpus}",
        critic_bundle,
    )


def check_cluster(plan: PlacementPlan, cluster_resources: dict[str, float], gpu_resource: str = "GPU") -> None:
    """The plan against what Ray reports (`ray.cluster_resources()`), with the arithmetic on failure."""
    have = int(cluster_resources.get(gpu_resource, 0))
    if plan.needed > have:
        raise PlacementError(f"{plan.arithmetic.rsplit(', cluster has', 1)[0]}, Ray cluster has {have} {gpu_resource}")


def check_nodes(plan: PlacementPlan, nodes: list[dict[str, float]], labels: list[str] | None = None) -> None:
    """The plan's bundles against each node's resources (`ray.nodes()` "Resources" of the alive nodes): a bundle
    lives on one node, so a cluster whose totals suffice can still not place it (a pending-forever placement
    group). First-fit decreasing; raises PlacementError naming what is missing, in seconds."""
    if plan.empty:
        return
    free = [dict(n) for n in nodes]
    names = labels or [f"node {i}" for i in range(len(nodes))]
    for index, bundle in sorted(enumerate(plan.bundles), key=lambda b: -sum(b[1].values())):
        for node in free:
            if all(node.get(k, 0) >= v for k, v in bundle.items()):
                for k, v in bundle.items():
                    node[k] -= v
                break
        else:
            biggest = {k: max((n.get(k, 0) for n in nodes), default=0) for k in bundle}
            short = ", ".join(
                f"{k} {v:g} (largest node has {biggest[k]:g})" for k, v in bundle.items() if biggest[k] < v
            )
            have = "; ".join(
                f"{lbl}: " + ", ".join(f"{k} {n.get(k, 0):g}" for k in bundle) for lbl, n in zip(names, nodes)
            )
            why = f"no node has {short}" if short else "the nodes' free resources run out (bundles do not pack)"
            raise PlacementError(
                f"placement group of {plan.needed} bundles {plan.bundles[0]} cannot be placed: bundle "
                f"{index} needs {bundle}, {why} ({have}); {plan.arithmetic}"
            )


def create_placement_group(
    plan: PlacementPlan,
    *,
    name: str | None = None,
    strategy: str = "PACK",
    timeout_s: float = 60.0,
    gpu_resource: str = "GPU",
):
    """Reserve the plan's bundles in the running Ray cluster (None for a CPU plan)."""
    import ray
    from ray.util.placement_group import placement_group

    if plan.empty:
        return None
    check_cluster(plan, ray.cluster_resources(), gpu_resource)
    alive = [n for n in ray.nodes() if n.get("Alive")]
    check_nodes(plan, [n.get("Resources", {}) for n in alive], [n.get("NodeManagerAddress", "?") for n in alive])
    pg = placement_group(plan.bundles, strategy=strategy, name=name or "")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(pg)
        raise PlacementError(
            f"placement group of {plan.needed} bundles not ready after {timeout_s:.0f}s "
            f"({plan.arithmetic}); is another run holding the GPUs?"
        )
    return pg


def ranks_per_node(bundle_nodes: dict[int, str], rank_bundles: list[int]) -> list[int]:
    """For each rank (placed in `rank_bundles[rank]`), how many of the ranks share its node: their host memory
    is one pool (the trainer's fit check counts what they park there together). `bundle_nodes`: bundle index
    -> node id, as Ray placed them; a bundle Ray has not placed counts as a node of its own."""
    nodes = [bundle_nodes.get(b) or f"unplaced-{b}" for b in rank_bundles]
    return [nodes.count(node) for node in nodes]


def bundle_nodes(pg) -> dict[int, str]:
    """Bundle index -> the id of the node Ray placed it on (from the GCS's placement group table)."""
    from ray.util import placement_group_table

    return {int(b): str(node) for b, node in placement_group_table(pg).get("bundles_to_node_id", {}).items() if node}


def actor_options(plan: PlacementPlan, pg, role: str, index: int = 0, *, gpu_resource: str = "GPU") -> dict[str, Any]:
    """`.options(...)` for the trainer / engine actor `index`: its bundle and GPU fraction ({} on CPU)."""
    if pg is None or plan.empty:
        return {}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    fraction = plan.gpu_fractions[role]
    options: dict[str, Any] = {
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=plan.actor_bundle(role, index)
        ),
        "num_cpus": 0,
    }
    if gpu_resource == "GPU":
        options["num_gpus"] = fraction
    else:
        options["resources"] = {gpu_resource: fraction}
    return options


class _GpuProbe:
    """Reports where Ray put it: node IP and the GPU ids assigned to its bundle."""

    def where(self) -> tuple[str, list[str]]:
        import ray

        return ray.util.get_node_ip_address(), [str(g) for g in ray.get_gpu_ids()]

    def address(self) -> tuple[str, int]:
        """This node's IP and a port free on it now (a rendezvous point for processes placed here)."""
        return node_ip(), free_port()


def bundle_address(pg, bundle: int, timeout_s: float = 60.0) -> tuple[str, int]:
    """(node IP, free port) on the node of `bundle`: where a process placed there can listen."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    probe = (
        ray.remote(_GpuProbe)
        .options(
            num_cpus=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle
            ),
        )
        .remote()
    )
    try:
        return tuple(ray.get(probe.address.remote(), timeout=timeout_s))  # type: ignore[return-value]
    finally:
        ray.kill(probe, no_restart=True)


def bundle_gpus(
    pg, bundles: list[int], *, gpu_resource: str = "GPU", timeout_s: float = 60.0
) -> list[tuple[str, str]] | None:
    """(node IP, GPU id) of each bundle, as Ray assigned them (a tiny probe actor per bundle takes a
    sliver of its GPU and reports `ray.get_gpu_ids()`). None for a custom GPU resource: Ray gives
    those no device ids."""
    if gpu_resource != "GPU" or not bundles:
        return None
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    probe_cls = ray.remote(_GpuProbe)
    probes = [
        probe_cls.options(
            num_cpus=0,
            num_gpus=0.001,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=b),
        ).remote()
        for b in bundles
    ]
    try:
        found = ray.get([p.where.remote() for p in probes], timeout=timeout_s)
    finally:
        for p in probes:
            ray.kill(p, no_restart=True)
    out = []
    for b, (node, gpus) in zip(bundles, found):
        if len(gpus) != 1:
            raise PlacementError(f"bundle {b} reports GPUs {gpus}; expected exactly one (one GPU per bundle)")
        out.append((node, gpus[0]))
    return out
