"""Start, find and stop the run's actors from a RunConfig (the flows' view of infra/workers)."""

from __future__ import annotations

from typing import Any

from rollflow.flows.config import RunConfig
from rollflow.infra.workers import Handle, actor_name, ensure_ray, get_actor, start_actor, stop_actor

ENGINE, TRAINER = "engine", "trainer"


def server_role(index: int) -> str:
    return f"{ENGINE}-server-{index}"


def connect_ray(cfg: RunConfig) -> None:
    ensure_ray(cfg.ray.address, cfg.ray.num_cpus)


# -- placement group (resources.num_gpus > 0; the CPU default has none and nothing below runs) ----
def uses_placement(cfg: RunConfig) -> bool:
    return cfg.resources.num_gpus > 0


def placement_group_name(cfg: RunConfig) -> str:
    return f"{cfg.run}:placement"


def _plan(cfg: RunConfig):
    from rollflow.infra.placement import plan_placement

    return plan_placement(cfg.placement, cfg.resources, train=not cfg.debug.rollout_only,
                          rollout=not cfg.debug.train_only)


def _lookup_placement_group(cfg: RunConfig):
    from ray.util import get_placement_group

    try:
        return get_placement_group(placement_group_name(cfg))
    except ValueError:
        return None


def start_placement(cfg: RunConfig):
    """Reserve the run's placement group once (named by run, so a task retry finds the same bundles);
    a leftover one of the same run is removed first. None on CPU."""
    import ray

    if not uses_placement(cfg):
        return None
    plan = _plan(cfg)
    if plan.empty:
        return None
    stale = _lookup_placement_group(cfg)
    if stale is not None:
        ray.util.remove_placement_group(stale)
    from rollflow.infra.placement import create_placement_group

    return create_placement_group(plan, name=placement_group_name(cfg), gpu_resource=cfg.resources.gpu_resource)


def stop_placement(cfg: RunConfig) -> None:
    import ray

    if not uses_placement(cfg):
        return
    pg = _lookup_placement_group(cfg)
    if pg is not None:
        ray.util.remove_placement_group(pg)


def placement_options(cfg: RunConfig, role: str, index: int = 0) -> dict[str, Any]:
    """The `.options()` putting `role`'s actor in its bundle of the run's placement group ({} on CPU)."""
    if not uses_placement(cfg):
        return {}
    from rollflow.infra.placement import actor_options

    plan = _plan(cfg)
    pg = _lookup_placement_group(cfg)
    if pg is None or plan.empty:
        return {}
    return actor_options(plan, pg, role, index, gpu_resource=cfg.resources.gpu_resource)


def engine_base_gpu_id(cfg: RunConfig, index: int = 0) -> int | None:
    """SGLang `--base-gpu-id` of engine `index` when its physical GPUs are unknown (a custom Ray GPU
    resource has no device ids): its first bundle's offset, set only when it spans several GPUs."""
    if not uses_placement(cfg) or cfg.resources.gpus_per_engine <= 1 or cfg.debug.train_only:
        return None
    return _plan(cfg).actor_bundle("engine", index)


def engine_gpu_ids(cfg: RunConfig, index: int = 0) -> list[str] | None:
    """The physical GPUs (as Ray numbers them on their node) of engine `index`'s bundles, in bundle
    order; None without a placement group or with a custom GPU resource."""
    if not uses_placement(cfg) or cfg.debug.train_only:
        return None
    pg = _lookup_placement_group(cfg)
    plan = _plan(cfg)
    if pg is None or plan.empty:
        return None
    from rollflow.infra.placement import bundle_gpus

    located = bundle_gpus(pg, plan.engine_bundles[index], gpu_resource=cfg.resources.gpu_resource)
    if located is None:
        return None
    nodes = {node for node, _ in located}
    if len(nodes) > 1:
        raise RuntimeError(f"engine {index}'s {len(located)} GPUs landed on {len(nodes)} nodes ({sorted(nodes)}): "
                           "an SGLang engine's tensor parallel group must be on one node; use "
                           "resources.gpus_per_engine <= GPUs per node")
    return [gpu for _, gpu in located]


def launches_servers(cfg: RunConfig) -> bool:
    """SGLang engines whose servers rollflow launches: one server actor per engine (in its bundle)."""
    return cfg.rollout.engine == "sglang" and not cfg.rollout.sglang.urls


def start_servers(cfg: RunConfig, weight_version: int) -> list:
    """Start every engine's server actor (in parallel: SGLang startup takes minutes), each in its
    bundle seeing exactly its GPUs; returns RemoteServers for the rollout worker."""
    import ray

    from rollflow.infra.remote_server import RemoteServer
    from rollflow.tasks.rollout.server_worker import SGLangServerWorker

    handles = []
    for k in range(cfg.resources.num_engines):
        gpu_ids = engine_gpu_ids(cfg, k)
        options = placement_options(cfg, ENGINE, k)
        handles.append(start_actor(
            cfg.run, server_role(k), SGLangServerWorker, cfg.model.path, cfg.rollout, index=k, gpu_ids=gpu_ids,
            base_gpu_id=None if gpu_ids else engine_base_gpu_id(cfg, k), weight_version=weight_version,
            wait=False, **({"options": options} if options else {})))
    try:
        ray.get([h.submit("ping") for h in handles])  # constructor errors (e.g. died at startup) surface here
        urls = ray.get([h.submit("url") for h in handles])
    except BaseException:
        stop_servers(cfg)
        raise
    return [RemoteServer(h.actor, url, name=actor_name(cfg.run, server_role(k)))
            for k, (h, url) in enumerate(zip(handles, urls))]


def stop_servers(cfg: RunConfig) -> None:
    for k in range(cfg.resources.num_engines):
        stop_actor(cfg.run, server_role(k))


def start_engine(cfg: RunConfig, resume_iteration: int | None, *, weights=None) -> Handle:
    """The engine on the model's weights, a checkpoint's, or given ones (an ObjectRef is fine).

    hf: one rollout worker in engine 0's bundle (the model runs in it). SGLang: one server actor per
    engine in its bundle(s), and a rollout worker (tokenizer, HTTP, load balancing; no GPU) over them.
    A restart starts everything again in the same bundles.
    """
    from rollflow.tasks.rollout.worker import RolloutWorker

    if weights is None and resume_iteration:
        weights = _checkpoint_weights(cfg, resume_iteration)
    extra: dict[str, Any] = {}
    if launches_servers(cfg):
        stop_actor(cfg.run, ENGINE)  # its servers are about to be replaced
        extra["servers"] = start_servers(cfg, resume_iteration or 0)
    else:
        options = placement_options(cfg, ENGINE)
        if options:
            extra["options"] = options
    return start_actor(cfg.run, ENGINE, RolloutWorker, cfg.model.path, cfg.rollout, cfg.data,
                       weights=weights, weight_version=resume_iteration or 0, **extra)


def ensure_engine(cfg: RunConfig, weight_version: int) -> Handle:
    """The live engine, or a restarted one at `weight_version` (how a task retry heals a dead actor).

    Weights come from the live trainer when there is one (it holds exactly that version), else from
    the run's checkpoint of that version, else from the model.
    """
    handle = get_actor(cfg.run, ENGINE)
    if handle is not None and handle.alive():
        return handle
    trainer = get_actor(cfg.run, TRAINER)
    if trainer is not None and trainer.alive():
        return start_engine(cfg, weight_version, weights=trainer.submit("named_weights"))
    return start_engine(cfg, weight_version or None)


def trainer_world_size(cfg: RunConfig) -> int:
    """Data-parallel trainer ranks: one per trainer GPU (one on CPU)."""
    return max(1, cfg.resources.trainer_gpus) if not cfg.debug.rollout_only else 0


def trainer_role(rank: int) -> str:
    # rank 0 keeps the plain role: everything that needs one rank (weights, checkpoints) asks it
    return TRAINER if rank == 0 else f"{TRAINER}-rank-{rank}"


def _rendezvous(cfg: RunConfig) -> tuple[str, int]:
    """Where the data-parallel ranks meet: rank 0's node (its bundle's, when placed) and a free port there."""
    from rollflow.infra.placement import bundle_address
    from rollflow.tasks.net import free_port, node_ip

    if uses_placement(cfg):
        pg = _lookup_placement_group(cfg)
        plan = _plan(cfg)
        if pg is not None and not plan.empty:
            return bundle_address(pg, plan.actor_bundle("trainer", 0))
    return node_ip(), free_port()


def start_trainer(cfg: RunConfig, resume_iteration: int | None) -> Handle:
    """Start every trainer rank (each in its bundle when placed); returns rank 0's handle.

    Several ranks (resources.trainer_gpus > 1): a data-parallel torch trainer; all ranks are started
    together because their constructors rendezvous (tasks/train/data_parallel.py).
    """
    import ray

    from rollflow.tasks.train.data_parallel import DataParallel
    from rollflow.tasks.train.worker import TrainWorker

    world = trainer_world_size(cfg)
    dps: list[DataParallel | None] = [None]
    if world > 1:
        address, port = _rendezvous(cfg)
        backend = "nccl" if cfg.train.device.startswith("cuda") else "gloo"
        dps = [DataParallel(rank=r, world_size=world, master_addr=address, master_port=port, backend=backend)
               for r in range(world)]
    handles = []
    for rank, dp in enumerate(dps):
        options = placement_options(cfg, TRAINER, rank)
        extra: dict[str, Any] = {"options": options} if options else {}
        if dp is not None:
            extra["dp"] = dp
        handles.append(start_actor(cfg.run, trainer_role(rank), TrainWorker, cfg.model.path, cfg.train, cfg.algo,
                                   store_root=cfg.store.root, run=cfg.run, temperature=cfg.rollout.temperature or 1.0,
                                   resume_iteration=resume_iteration or None, wait=False, **extra))
    try:
        ray.get([h.submit("ping") for h in handles])  # constructor errors (and the rendezvous) surface here
    except BaseException:
        stop_trainers(cfg)
        raise
    return handles[0]


def trainer_ranks(cfg: RunConfig) -> list[Handle]:
    handles = [get_actor(cfg.run, trainer_role(r)) for r in range(max(1, trainer_world_size(cfg)))]
    missing = [trainer_role(r) for r, h in enumerate(handles) if h is None]
    if missing:
        raise RuntimeError(f"trainer ranks {missing} of run {cfg.run!r} are not running: start the run's workers "
                           "first (rl_train does); a lost rank means restarting the run from its checkpoint")
    return handles  # type: ignore[return-value]


def call_all_ranks(cfg: RunConfig, method: str, *args, **kwargs):
    """Call `method` on every trainer rank at once (it runs collectives) and return rank 0's result."""
    import ray

    refs = [h.submit(method, *args, **kwargs) for h in trainer_ranks(cfg)]
    return ray.get(refs)[0]


def stop_trainers(cfg: RunConfig) -> None:
    for rank in range(max(1, cfg.resources.trainer_gpus)):
        stop_actor(cfg.run, trainer_role(rank))


def _checkpoint_weights(cfg: RunConfig, iteration: int):
    import io

    import torch

    from rollflow.tasks.train.checkpoint import load_checkpoint

    payload = load_checkpoint(cfg.store.root, cfg.run, iteration)
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)["model"]


def require(cfg: RunConfig, role: str) -> Handle:
    handle = get_actor(cfg.run, role)
    if handle is None:
        raise RuntimeError(f"no {role} actor for run {cfg.run!r}: start the run's workers first (rl_train does)")
    return handle


def stop_all(cfg: RunConfig) -> None:
    """Stop the run's actors, then release its placement group (if it has one)."""
    stop_actor(cfg.run, ENGINE)
    stop_trainers(cfg)
    stop_servers(cfg)
    stop_placement(cfg)


def abort_rollout(cfg: RunConfig) -> int:
    """Abort the engine's in-flight requests now (runs beside a rollout in the actor's control group);
    the rollout returns with those samples aborted. Returns the abort calls sent (0: no engine)."""
    handle = get_actor(cfg.run, ENGINE)
    return int(handle.control("abort")) if handle is not None else 0
