"""The run's worker group from a RunConfig: placement, start / restart / stop of its actors, and the
typed clients flows/ calls them through (`rollflow.infra.clients`).

`WorkerGroup.for_run(cfg)` computes the placement plan once and holds it. The actors are detached
and named by run, so a task builds its group from `cfg` alone: a task running on a retry finds the
same actors (and placement group), or restarts a dead engine (`ensure_engine`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from rollflow.flows.cluster_checks import alive_nodes, check_store_for_nodes
from rollflow.flows.config import RunConfig
from rollflow.infra.clients import CriticClient, EngineClient, Pending, ServerClient, TrainerClient
from rollflow.infra.placement import (
    PlacementPlan,
    actor_options,
    bundle_address,
    bundle_gpus,
    bundle_nodes,
    create_placement_group,
    plan_placement,
    ranks_per_node,
)
from rollflow.infra.remote_server import RemoteServer
from rollflow.infra.workers import actor_name, ensure_ray, get_actor, missing_actor_error, start_actor, stop_actor
from rollflow.tasks.debug.slow_training import SlowTrainWorker
from rollflow.tasks.debug.stale_serving import StaleServingWorker
from rollflow.tasks.model.source import resolve_model_path
from rollflow.tasks.net import free_port, node_ip
from rollflow.tasks.rollout.sglang.server_worker import SGLangServerWorker
from rollflow.tasks.rollout.worker import RolloutWorker
from rollflow.tasks.train.checkpoint import load_checkpoint
from rollflow.tasks.train.checkpoint_weights import hf_weights_of_checkpoint
from rollflow.tasks.train.critic_worker import CriticWorker
from rollflow.tasks.train.data_parallel import DataParallel
from rollflow.tasks.train.memory_fit import engine_host_bytes_per_param
from rollflow.tasks.train.worker import TrainWorker

if TYPE_CHECKING:
    import torch

ENGINE, TRAINER, CRITIC = "engine", "trainer", "critic"


def server_role(index: int) -> str:
    return f"{ENGINE}-server-{index}"


def trainer_role(rank: int) -> str:
    # rank 0 keeps the plain role: everything that needs one rank (weights, checkpoints) asks it
    return TRAINER if rank == 0 else f"{TRAINER}-rank-{rank}"


def connect_ray(cfg: RunConfig) -> None:
    ensure_ray(cfg.ray.address, cfg.ray.num_cpus)
    if cfg.ray.address:  # nodes of a cluster share no disk: a local store.root is refused before any worker starts
        check_store_for_nodes(cfg, alive_nodes())


def uses_placement(cfg: RunConfig) -> bool:
    """A placement group only with GPUs (resources.num_gpus > 0); the CPU default has none."""
    return cfg.resources.num_gpus > 0


def placement_group_name(cfg: RunConfig) -> str:
    return f"{cfg.run}:placement"


def launches_servers(cfg: RunConfig) -> bool:
    """SGLang engines whose servers rollflow launches: one server actor per engine (in its bundle)."""
    return cfg.rollout.engine == "sglang" and not cfg.rollout.sglang.urls


def has_critic(cfg: RunConfig) -> bool:
    """advantage_estimator='ppo': a critic actor beside the trainer (rollout-only runs train nothing)."""
    return cfg.algo.advantage_estimator == "ppo" and not cfg.debug.rollout_only


def trainer_world_size(cfg: RunConfig) -> int:
    """Data-parallel trainer ranks: one per trainer GPU (one on CPU)."""
    return max(1, cfg.resources.trainer_gpus) if not cfg.debug.rollout_only else 0


@dataclasses.dataclass(frozen=True, eq=False)
class WorkerGroup:
    """The run's actors (trainer ranks, rollout worker, SGLang server actors) and where they go.

    `plan`: the placement plan, computed once by `for_run`; None without GPUs (nothing is placed).
    Debug modes are groups with parts missing: rollout-only starts no trainer, replay no engine.
    """

    cfg: RunConfig
    plan: PlacementPlan | None

    @classmethod
    def for_run(cls, cfg: RunConfig) -> WorkerGroup:
        plan = None
        if uses_placement(cfg):
            plan = plan_placement(
                cfg.placement,
                cfg.resources,
                train=not cfg.debug.rollout_only,
                rollout=not cfg.debug.train_only,
                critic=has_critic(cfg),
            )
            plan = None if plan.empty else plan
        return cls(cfg, plan)

    @property
    def run(self) -> str:
        return self.cfg.run

    # -- the clients of running actors (found by run name) -------------------------------------------
    def trainer(self) -> TrainerClient:
        """Every trainer rank; raises when one is not running."""
        world = max(1, trainer_world_size(self.cfg))
        ranks = [get_actor(self.run, trainer_role(r)) for r in range(world)]
        missing = [trainer_role(r) for r, actor in enumerate(ranks) if actor is None]
        if missing and world == 1:
            raise missing_actor_error(self.run, TRAINER)
        if missing:
            raise RuntimeError(
                f"trainer ranks {missing} of run {self.run!r} are not running: start the run's workers "
                "first (rl_train does); a lost rank means restarting the run from its checkpoint"
            )
        return TrainerClient(ranks)

    def critic(self) -> CriticClient:
        """The critic of a ppo run; raises when it is not running."""
        actor = get_actor(self.run, CRITIC)
        if actor is None:
            raise missing_actor_error(self.run, CRITIC)
        return CriticClient(actor)

    def find_engine(self) -> EngineClient | None:
        actor = get_actor(self.run, ENGINE)
        return EngineClient(actor) if actor is not None else None

    def engine(self) -> EngineClient:
        """The rollout worker; raises when it is not running (`ensure_engine` restarts a dead one)."""
        engine = self.find_engine()
        if engine is None:
            raise missing_actor_error(self.run, ENGINE)
        return engine

    def server(self, index: int) -> ServerClient:
        """Engine `index`'s SGLang server actor (engines whose servers rollflow launches)."""
        actor = get_actor(self.run, server_role(index))
        if actor is None:
            raise RuntimeError(f"no {server_role(index)} actor for run {self.run!r}")
        return ServerClient(actor)

    # -- placement group (None / nothing on CPU) -----------------------------------------------------
    def placement_group(self):
        """The run's placement group if it is reserved (looked up by name), else None."""
        from ray.util import get_placement_group

        try:
            return get_placement_group(placement_group_name(self.cfg))
        except ValueError:
            return None

    def start_placement(self):
        """Reserve the run's placement group once (named by run, so a task retry finds the same bundles);
        a leftover one of the same run is removed first. None on CPU."""
        import ray

        if self.plan is None:
            return None
        stale = self.placement_group()
        if stale is not None:
            ray.util.remove_placement_group(stale)
        return create_placement_group(
            self.plan, name=placement_group_name(self.cfg), gpu_resource=self.cfg.resources.gpu_resource
        )

    def stop_placement(self) -> None:
        import ray

        if not uses_placement(self.cfg):
            return
        pg = self.placement_group()
        if pg is not None:
            ray.util.remove_placement_group(pg)

    def placement_options(self, role: str, index: int = 0) -> dict[str, Any]:
        """The `.options()` putting `role`'s actor in its bundle of the run's placement group ({} on CPU)."""
        if self.plan is None:
            return {}
        pg = self.placement_group()
        if pg is None:
            return {}
        return actor_options(self.plan, pg, role, index, gpu_resource=self.cfg.resources.gpu_resource)

    def engine_base_gpu_id(self, index: int = 0) -> int | None:
        """SGLang `--base-gpu-id` of engine `index` when its physical GPUs are unknown (a custom Ray GPU
        resource has no device ids): its first bundle's offset, set only when it spans several GPUs."""
        if self.plan is None or self.cfg.resources.gpus_per_engine <= 1 or self.cfg.debug.train_only:
            return None
        return self.plan.actor_bundle(ENGINE, index)

    def engine_gpu_ids(self, index: int = 0) -> list[str] | None:
        """The physical GPUs (as Ray numbers them on their node) of engine `index`'s bundles, in bundle
        order; None without a placement group or with a custom GPU resource."""
        if self.plan is None or self.cfg.debug.train_only:
            return None
        pg = self.placement_group()
        if pg is None:
            return None
        located = bundle_gpus(pg, self.plan.engine_bundles[index], gpu_resource=self.cfg.resources.gpu_resource)
        if located is None:
            return None
        nodes = {node for node, _ in located}
        if len(nodes) > 1:
            raise RuntimeError(
                f"engine {index}'s {len(located)} GPUs landed on {len(nodes)} nodes ({sorted(nodes)}): "
                "an SGLang engine's tensor parallel group must be on one node; use "
                "resources.gpus_per_engine <= GPUs per node"
            )
        return [gpu for _, gpu in located]

    def trainer_node_sharing(self, world: int) -> tuple[list[int], list[float]]:
        """For each trainer rank, who shares its node's host memory: (the trainer ranks on it, their parked state
        adding up; the host memory the node's engines keep while it trains, in bytes per model parameter).

        Engines: `memory_fit.engine_host_bytes_per_param` each. Placed: as Ray placed the bundles (an engine by
        its first bundle); not placed: everything on a one-node Ray, else 1 rank and 0 engines each (unknown, and
        the fit check stays a lower bound)."""
        cfg = self.cfg
        has_engine = not (cfg.debug.train_only or cfg.debug.rollout_only)
        per_engine = engine_host_bytes_per_param(cfg.rollout.engine, cfg.rollout.dtype) if has_engine else 0.0
        pg = self.placement_group() if self.plan is not None else None
        if pg is not None:
            nodes = bundle_nodes(pg)
            rank_bundles = [self.plan.actor_bundle(TRAINER, r) for r in range(world)]
            engine_nodes = [nodes.get(bundles[0]) for bundles in self.plan.engine_bundles]
            rank_nodes = [nodes.get(b) for b in rank_bundles]
            engines = [per_engine * engine_nodes.count(node) if node else 0.0 for node in rank_nodes]
            return ranks_per_node(nodes, rank_bundles), engines
        if alive_nodes() == 1:
            return [world] * world, [per_engine * cfg.resources.num_engines] * world
        return [1] * world, [0.0] * world

    def _rendezvous(self) -> tuple[str, int]:
        """Where the data-parallel ranks meet: rank 0's node (its bundle's, when placed) and a free port there."""
        if self.plan is not None:
            pg = self.placement_group()
            if pg is not None:
                return bundle_address(pg, self.plan.actor_bundle(TRAINER, 0))
        return node_ip(), free_port()

    # -- engines -------------------------------------------------------------------------------------
    def start_servers(self, weight_version: int) -> list[RemoteServer]:
        """Start every engine's server actor (in parallel: SGLang startup takes minutes), each in its
        bundle seeing exactly its GPUs; returns RemoteServers for the rollout worker."""
        cfg = self.cfg
        servers = []
        for k in range(cfg.resources.num_engines):
            gpu_ids = self.engine_gpu_ids(k)
            options = self.placement_options(ENGINE, k)
            servers.append(
                ServerClient(
                    start_actor(
                        cfg.run,
                        server_role(k),
                        SGLangServerWorker,
                        cfg.model.path,
                        cfg.rollout,
                        index=k,
                        gpu_ids=gpu_ids,
                        base_gpu_id=None if gpu_ids else self.engine_base_gpu_id(k),
                        weight_version=weight_version,
                        wait=False,
                        **({"options": options} if options else {}),
                    )
                )
            )
        try:
            urls = ServerClient.wait_started(servers)
        except BaseException:
            self.stop_servers()
            raise
        return [
            RemoteServer(s.actor, url, name=actor_name(cfg.run, server_role(k)))
            for k, (s, url) in enumerate(zip(servers, urls))
        ]

    def stop_servers(self) -> None:
        for k in range(self.cfg.resources.num_engines):
            stop_actor(self.run, server_role(k))

    def start_engine(
        self,
        resume_iteration: int | None,
        *,
        weights: Pending[dict[str, torch.Tensor]] | dict[str, torch.Tensor] | None = None,
    ) -> EngineClient:
        """The engine on the model's weights, a checkpoint's, or given ones (e.g. `trainer.named_weights()`).

        hf: one rollout worker in engine 0's bundle (the model runs in it). SGLang: one server actor per
        engine in its bundle(s), and a rollout worker (tokenizer, HTTP, load balancing; no GPU) over them.
        A restart starts everything again in the same bundles.
        """
        cfg = self.cfg
        if weights is None and resume_iteration:
            # A running trainer has loaded that checkpoint: its weights are HF-named whatever its checkpoint format
            # (a sharded trainer's is Megatron's distributed one, which only the trainer ranks can read).
            weights = self._live_trainer_weights() or _checkpoint_weights(cfg, resume_iteration)
        extra: dict[str, Any] = {}
        if launches_servers(cfg):
            stop_actor(cfg.run, ENGINE)  # its servers are about to be replaced
            extra["servers"] = self.start_servers(resume_iteration or 0)
        else:
            options = self.placement_options(ENGINE)
            if options:
                extra["options"] = options
        named = weights.ref if isinstance(weights, Pending) else weights  # a ref goes trainer -> engine directly
        if cfg.rollout.logprobs == "teacher_forced":
            extra["scoring"] = cfg.scoring_layout()  # the engine rescoring like the trainer (bitwise log-probs)
        if cfg.algo.routing_replay:
            extra["record_routes"] = True  # MoE routing replay: every sample carries its experts
        worker_cls = StaleServingWorker if cfg.debug.serve_stale else RolloutWorker  # a fault drill (docs/checks.md)
        return EngineClient(
            start_actor(
                cfg.run,
                ENGINE,
                worker_cls,
                cfg.model.path,
                cfg.rollout,
                cfg.data,
                weights=named,
                weight_version=resume_iteration or 0,
                compile_cache=cfg.compile_cache_uri(),
                **extra,
            )
        )

    def ensure_engine(self, weight_version: int) -> EngineClient:
        """The live engine, or a restarted one at `weight_version` (how a task retry heals a dead actor).

        Weights come from the live trainer when there is one (it holds exactly that version), else from
        the run's checkpoint of that version, else from the model.
        """
        engine = self.find_engine()
        if engine is not None and engine.alive():
            return engine
        weights = self._live_trainer_weights()
        if weights is not None:
            return self.start_engine(weight_version, weights=weights)
        return self.start_engine(weight_version or None)

    def _live_trainer_weights(self) -> Pending[dict[str, torch.Tensor]] | None:
        """The running trainer's HF-named weights (every rank takes part when it is sharded), else None."""
        if get_actor(self.run, TRAINER) is None:
            return None
        try:
            trainer = self.trainer()
        except RuntimeError:
            return None
        return trainer.named_weights() if trainer.alive() else None

    def abort_rollout(self) -> int:
        """Abort the engine's in-flight requests now (runs beside a rollout in the actor's control group);
        the rollout returns with those samples aborted. Returns the abort calls sent (0: no engine)."""
        engine = self.find_engine()
        return engine.abort() if engine is not None else 0

    # -- trainer -------------------------------------------------------------------------------------
    def start_trainer(self, resume_iteration: int | None) -> TrainerClient:
        """Start every trainer rank (each in its bundle when placed).

        Several ranks (resources.trainer_gpus > 1): a data-parallel torch trainer; all ranks are started
        together because their constructors rendezvous (tasks/train/data_parallel.py).
        """
        cfg = self.cfg
        world = trainer_world_size(cfg)
        dps: list[DataParallel | None] = [None]
        if world > 1:
            address, port = self._rendezvous()
            backend = "nccl" if cfg.train.device.startswith("cuda") else "gloo"
            dps = [
                DataParallel(rank=r, world_size=world, master_addr=address, master_port=port, backend=backend)
                for r in range(world)
            ]
        ranks = []
        # replay trains with no engine to make room for (and its form has no placement)
        parks_on_host = not cfg.debug.train_only and cfg.placement == "colocate" and cfg.offload
        on_host = parks_on_host or not cfg.train.device.startswith("cuda")  # CPU ranks keep everything there
        node_ranks, engine_bytes = self.trainer_node_sharing(world) if on_host else ([1] * world, [0.0] * world)
        worker_cls = SlowTrainWorker if cfg.debug.slow_train_s else TrainWorker  # a fault drill (docs/checks.md)
        for rank, dp in enumerate(dps):
            options = self.placement_options(TRAINER, rank)
            extra: dict[str, Any] = {"options": options} if options else {}
            if dp is not None:
                extra["dp"] = dp
            if cfg.debug.slow_train_s:
                extra["slow_train_s"] = cfg.debug.slow_train_s
            if cfg.model.lora is not None:
                extra["lora"] = cfg.model.lora
            ranks.append(
                start_actor(
                    cfg.run,
                    trainer_role(rank),
                    worker_cls,
                    cfg.model.path,
                    cfg.train,
                    cfg.algo,
                    store_root=cfg.store.root,
                    run=cfg.run,
                    temperature=cfg.rollout.temperature or 1.0,
                    resume_iteration=resume_iteration or None,
                    compile_cache=cfg.compile_cache_uri(),
                    parks_on_host=parks_on_host,
                    node_ranks=node_ranks[rank],
                    engine_host_bytes_per_param=engine_bytes[rank],
                    wait=False,
                    **extra,
                )
            )
        trainer = TrainerClient(ranks)
        try:
            trainer.wait_started()  # constructor errors (and the rendezvous) surface here
        except BaseException:
            self.stop_trainers()
            raise
        return trainer

    def stop_trainers(self) -> None:
        for rank in range(max(1, self.cfg.resources.trainer_gpus)):
            stop_actor(self.run, trainer_role(rank))
        stop_actor(self.run, CRITIC)

    def start_critic(self, resume_iteration: int | None) -> CriticClient | None:
        """ppo's critic actor (None for other estimators): the policy's base model + a value head, resumed from
        the critic state saved with checkpoint `resume_iteration`. With GPUs it runs in its bundle of the
        placement (its own GPU, or a share of trainer rank 0's: resources.critic_gpus) on train.device."""
        if not has_critic(self.cfg):
            return None
        cfg = self.cfg
        options = self.placement_options(CRITIC)
        return CriticClient(
            start_actor(
                cfg.run,
                CRITIC,
                CriticWorker,
                cfg.model.path,
                cfg.train,
                cfg.algo,
                store_root=cfg.store.root,
                run=cfg.run,
                resume_iteration=resume_iteration or None,
                **({"options": options} if options else {}),
            )
        )

    # -- all -----------------------------------------------------------------------------------------
    def stop_all(self) -> None:
        """Stop the run's actors, then release its placement group (if it has one)."""
        stop_actor(self.run, ENGINE)
        self.stop_trainers()
        self.stop_servers()
        self.stop_placement()

    def any_running(self) -> bool:
        """Whether the engine or trainer (rank 0) is still registered (a kill frees the name shortly after)."""
        return any(get_actor(self.run, role) is not None for role in (ENGINE, TRAINER))


def _checkpoint_weights(cfg: RunConfig, iteration: int):
    payload = load_checkpoint(cfg.store.root, cfg.run, iteration)
    try:
        return hf_weights_of_checkpoint(payload, resolve_model_path(cfg.model.path))
    except ValueError as exc:
        raise ValueError(f"checkpoint {iteration} of run {cfg.run!r}: {exc}") from None
