"""Start, find and stop the run's actors from a RunConfig (the flows' view of infra/workers)."""

from __future__ import annotations

from flows.config import RunConfig
from infra.workers import Handle, ensure_ray, get_actor, start_actor, stop_actor

ENGINE, TRAINER = "engine", "trainer"


def connect_ray(cfg: RunConfig) -> None:
    ensure_ray(cfg.ray.address, cfg.ray.num_cpus)


def start_engine(cfg: RunConfig, resume_iteration: int | None, *, weights=None) -> Handle:
    """The engine on the model's weights, a checkpoint's, or given ones (an ObjectRef is fine)."""
    from tasks.rollout.worker import RolloutWorker

    if weights is None and resume_iteration:
        weights = _checkpoint_weights(cfg, resume_iteration)
    return start_actor(cfg.run, ENGINE, RolloutWorker, cfg.model.path, cfg.rollout, cfg.data,
                       weights=weights, weight_version=resume_iteration or 0)


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

    return start_actor(cfg.run, TRAINER, TrainWorker, cfg.model.path, cfg.train, cfg.algo,
                       store_root=cfg.store.root, run=cfg.run, temperature=cfg.rollout.temperature or 1.0,
                       resume_iteration=resume_iteration or None)


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
    for role in (ENGINE, TRAINER):
        stop_actor(cfg.run, role)
