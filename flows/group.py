"""Start, find and stop the run's actors from a RunConfig (the flows' view of infra/workers)."""

from __future__ import annotations

from typing import Any

from flows.config import RunConfig
from infra.workers import Handle, ensure_ray, get_actor, start_actor, stop_actor

ENGINE, TRAINER = "engine", "trainer"


def connect_ray(cfg: RunConfig) -> None:
    ensure_ray(cfg.ray.address, cfg.ray.num_cpus)


# -- placement group (resources.num_gpus > 0; the CPU default has none and nothing below runs) ----
def uses_placement(cfg: RunConfig) -> bool:
    return cfg.resources.num_gpus > 0


def placement_group_name(cfg: RunConfig) -> str:
    return f"{cfg.run}:placement"


def _plan(cfg: RunConfig):
    from infra.placement import plan_placement

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
    from infra.placement import create_placement_group

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
    from infra.placement import actor_options

    plan = _plan(cfg)
    pg = _lookup_placement_group(cfg)
    if pg is None or plan.empty:
        return {}
    return actor_options(plan, pg, role, index, gpu_resource=cfg.resources.gpu_resource)


def engine_base_gpu_id(cfg: RunConfig, index: int = 0) -> int | None:
    """SGLang `--base-gpu-id` of engine `index`: its first bundle's offset in the placement group, set
    only when the engine spans several GPUs (a 1-GPU engine uses the GPU Ray gives its actor)."""
    if not uses_placement(cfg) or cfg.resources.gpus_per_engine <= 1 or cfg.debug.train_only:
        return None
    return _plan(cfg).actor_bundle("engine", index)


def start_engine(cfg: RunConfig, resume_iteration: int | None, *, weights=None) -> Handle:
    """The engine on the model's weights, a checkpoint's, or given ones (an ObjectRef is fine); inside
    its bundle of the run's placement group when there is one (so a restart lands in the same one)."""
    from tasks.rollout.worker import RolloutWorker

    if weights is None and resume_iteration:
        weights = _checkpoint_weights(cfg, resume_iteration)
    extra: dict[str, Any] = {}
    options = placement_options(cfg, ENGINE)
    if options:
        extra["options"] = options
    base_gpu_id = engine_base_gpu_id(cfg)
    if base_gpu_id is not None:
        extra["base_gpu_id"] = base_gpu_id
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


def start_trainer(cfg: RunConfig, resume_iteration: int | None) -> Handle:
    from tasks.train.worker import TrainWorker

    options = placement_options(cfg, TRAINER)
    extra: dict[str, Any] = {"options": options} if options else {}
    return start_actor(cfg.run, TRAINER, TrainWorker, cfg.model.path, cfg.train, cfg.algo,
                       store_root=cfg.store.root, run=cfg.run, temperature=cfg.rollout.temperature or 1.0,
                       resume_iteration=resume_iteration or None, **extra)


def _checkpoint_weights(cfg: RunConfig, iteration: int):
    import io

    import torch

    from tasks.train.checkpoint import load_checkpoint

    payload = load_checkpoint(cfg.store.root, cfg.run, iteration)
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)["model"]


def require(cfg: RunConfig, role: str) -> Handle:
    handle = get_actor(cfg.run, role)
    if handle is None:
        raise RuntimeError(f"no {role} actor for run {cfg.run!r}: start the run's workers first (rl_train does)")
    return handle


def stop_all(cfg: RunConfig) -> None:
    """Stop the run's actors, then release its placement group (if it has one)."""
    for role in (ENGINE, TRAINER):
        stop_actor(cfg.run, role)
    stop_placement(cfg)
