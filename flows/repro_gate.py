"""The bitwise reproducibility gate and the group-diversity guard: the same short config run twice in fresh workers.

Each pass is a run of its own (`{run}-repro-a`, `{run}-repro-b`: fresh actors, a fresh store folder) through
the real loop (`rl_iteration`: generate, reward, persist, train, sync, checkpoint); then what both committed
(token ids, rewards, rollout and trainer log-probs, advantages, losses per optimizer step, metrics, final
weights) is compared bit for bit (tasks/debug/repro.py). Run by `alignment_check(reproducibility=True)`
(`rollflow align --repro`, the nightly deployment's `reproducibility` parameter).
"""

from __future__ import annotations

import io

import torch

from rollflow.artifacts.storage import open_fs
from rollflow.artifacts.store import RolloutStore
from rollflow.flows import reporting
from rollflow.flows.actor_calls import ActorRunner, stop_and_wait
from rollflow.flows.config import RunConfig
from rollflow.flows.group import WorkerGroup, connect_ray
from rollflow.flows.iteration import run_iteration
from rollflow.flows.prefect_ops.cancellation import actors_running
from rollflow.tasks.debug.checks import CheckResult
from rollflow.tasks.debug.faults import AlignmentFaults
from rollflow.tasks.debug.repro import IterationTrace, RunTrace, diversity_check, repro_check
from rollflow.tasks.debug.repro_faults import engine_greedy_sampling, trainer_logit_noise
from rollflow.tasks.train.checkpoint import load_checkpoint
from rollflow.tasks.train.lora import LORA_FORMAT
from rollflow.tasks.train.records import read_records, train_record_uri

PASSES = ("a", "b")


def pass_config(cfg: RunConfig, label: str) -> RunConfig:
    """The gate's own run per pass: a fresh start, one checkpoint per iteration (the final weights)."""
    data = cfg.model_dump()
    data["run"] = f"{cfg.run[:88]}-repro-{label}"
    data["resume"] = False
    data["resume_from"] = None
    data["eval_every"] = 0  # eval draws its own samples: not part of what the gate compares
    return RunConfig.model_validate(data)


def clear_run(cfg: RunConfig) -> None:
    """The gate owns `{run}-repro-*`: an earlier gate's artifacts would be reused, not regenerated."""
    fs, path = open_fs(RolloutStore(cfg.store.root).path_uri(cfg.run))
    if fs.exists(path):
        fs.rm(path, recursive=True)


def run_pass(cfg: RunConfig, faults: AlignmentFaults, *, inject_noise: bool) -> None:
    clear_run(cfg)
    connect_ray(cfg)
    group = WorkerGroup.for_run(cfg)
    stop_and_wait(group)  # fresh workers: never an actor of an earlier pass or gate
    with actors_running(group.stop_all, cleanup=lambda: stop_and_wait(group)):
        reporting.stage(f"repro-{cfg.run}")
        group.start_placement()
        trainer = group.start_trainer(None)
        group.start_critic(None)
        engine = group.start_engine(None)
        if faults.greedy_sampling:
            ActorRunner(engine.actor).run(engine_greedy_sampling)
        if inject_noise and faults.nondeterministic_logits_std:
            ActorRunner(trainer.actor).run(trainer_logit_noise, faults.nondeterministic_logits_std)
        for rollout_id in range(cfg.iterations):
            run_iteration(cfg, rollout_id)
    stop_and_wait(group)


def read_trace(cfg: RunConfig) -> RunTrace:
    store = RolloutStore(cfg.store.root)
    metrics = {row["rollout_id"]: row for row in reporting.read_metrics(cfg)}
    steps = reporting.read_train_steps(cfg)
    iterations = []
    for rollout_id in range(cfg.iterations):
        samples = store.load(cfg.run, "train", rollout_id).samples
        fs, path = open_fs(train_record_uri(cfg.store.root, cfg.run, rollout_id))
        with fs.open(path, "rb") as f:
            records = read_records(f.read()).columns
        key = cfg.rollout.reward_key_for("train")
        iterations.append(
            IterationTrace(
                rollout_id=rollout_id,
                tokens=[list(s.tokens) for s in samples],
                rewards=[s.scalar_reward(key) if s.reward is not None else None for s in samples],
                rollout_log_probs=[list(s.rollout_log_probs or []) for s in samples],
                records=records,
                metrics=metrics.get(rollout_id, {}),
                steps=[r for r in steps if r.get("iteration") == rollout_id + 1],
            )
        )
    state = torch.load(
        io.BytesIO(load_checkpoint(cfg.store.root, cfg.run, cfg.iterations)), map_location="cpu", weights_only=True
    )
    # A LoRA run's checkpoint holds its adapter (the base is model.path's): the adapter is what the runs trained.
    return RunTrace(cfg.run, iterations, dict(state["adapter" if state.get("format") == LORA_FORMAT else "model"]))


def run_repro_gate(
    cfg: RunConfig, faults: AlignmentFaults | None = None, *, max_identical_fraction: float = 0.5
) -> list[CheckResult]:
    """The two checks' results. `faults.nondeterministic_logits_std` goes into the second pass only (the gate
    must then fail); `faults.greedy_sampling` into both (the diversity guard must then fail)."""
    faults = faults or AlignmentFaults()
    configs = [pass_config(cfg, label) for label in PASSES]
    for label, pcfg in zip(PASSES, configs):
        run_pass(pcfg, faults, inject_noise=label == "b")
    a, b = (read_trace(pcfg) for pcfg in configs)
    temperature = float(cfg.rollout.temperature or 0.0)
    return [
        repro_check(a, b),
        diversity_check(
            a.iterations, cfg.rollout.n_samples_per_prompt, temperature, max_fraction=max_identical_fraction
        ),
    ]
