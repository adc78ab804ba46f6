"""Precision alignment: slime's debug.md step-1 / step-2 checks as one plain function.

    report = run_alignment(rollout_worker, train_worker, cfg)   # plain objects, this process
    print(report.to_markdown())

Six checks, each a `CheckResult` (pass / warn / fail, figures, likely causes):

1. coherence                   rollouts are language (printable, repetition, format, reference NLL)
2. step1_logprob_equals_ref    step 1: log_probs == ref_log_probs exactly (kl 0), and not large
3. train_rollout_logprob_diff  |trainer log-prob - engine log-prob| over response tokens, worst samples
4. one_step_update             one rollout, one step: ppo_kl 0, pg_clipfrac 0, grad_norm bounded
5. weight_sync_parity          after the update every engine tensor equals the trainer's (names mapped)
6. step2_load_and_memory       iteration 2 runs on the updated weights; peak memory vs a budget

The workers are reached through a `WorkerRunner`, which runs a module-level function next to the
worker's state: `InProcess` (wrapped automatically around a `RolloutWorker`, `TrainWorker` or
`TorchBackend`), or the flow's Ray-actor runner. Tensors stay inside the workers; only samples,
figures and (for the sync) the weights themselves move.

Fault injection is explicit: `faults=AlignmentFaults(...)` breaks exactly one check each.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import time
import traceback
from typing import Any, Callable, Optional, Protocol, TypeVar

import torch

from rollflow.artifacts.sample import Sample
from rollflow.tasks.debug.checks import FAIL, PASS, AlignmentReport, AlignmentThresholds, CheckResult
from rollflow.tasks.debug.coherence import NAME as COHERENCE
from rollflow.tasks.debug.coherence import answer_format, coherence_check, response_stats
from rollflow.tasks.debug.faults import (
    AlignmentFaults,
    apply_sync_fault,
    perturb_module,
    perturb_tensors,
    scramble_module,
)
from rollflow.tasks.debug.memory import peak_memory
from rollflow.tasks.debug.sync_check import NAME as SYNC
from rollflow.tasks.debug.sync_check import sync_check
from rollflow.tasks.debug.train_checks import (
    FIRST_STEP,
    MISMATCH,
    MISMATCH_KL,
    REF_EQUAL,
    backend_of,
    first_step_check,
    first_step_figures,
    mismatch_check,
    mismatch_kl_check,
    ref_equal_check,
    train_step_figures,
)
from rollflow.tasks.model.teacher_forced import ScoringLayout
from rollflow.tasks.rollout.generate import generate_samples
from rollflow.tasks.rollout.rewards import reward_fn_from_config, score_samples
from rollflow.tasks.rollout.settings import DataConfig, RolloutConfig, prompts_for
from rollflow.tasks.rollout.worker import RolloutWorker
from rollflow.tasks.sync.capabilities import HoldsModule
from rollflow.tasks.sync.parity import NameMap, checksums, compare
from rollflow.tasks.train.capabilities import HostReference, ModuleReference
from rollflow.tasks.train.settings import AlgoConfig, OptimConfig
from rollflow.tasks.train.worker import TrainWorker

STEP2 = "step2_load_and_memory"
CHECK_NAMES = (COHERENCE, REF_EQUAL, MISMATCH, MISMATCH_KL, FIRST_STEP, SYNC, STEP2)

LOAD_CAUSES = [
    "the engine did not take the update (weight_version not advanced) or generated with stale weights",
    "the second iteration crashed: see the message (often memory the first iteration did not release)",
]
MEMORY_CAUSES = [
    "batches too large for the budget: lower train.micro_batch_size or rollout.max_batch_size",
    "engine memory (weights / KV cache) not released while the trainer runs (colocate offload)",
    "tensors kept across iterations (a leak: batches, autograd graphs or old weights still referenced)",
    "the budget is too small for this model and batch size",
]

T = TypeVar("T")
Phase = Callable[[str, Callable[[], Any]], Any]


class WorkerRunner:
    """Runs `fn(worker, *args, **kwargs)` where the worker lives and returns the result."""

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        raise NotImplementedError

    def defer(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Like `run`, but may return a reference that another runner's `run` accepts as an argument
        (Ray: an ObjectRef, so weights go worker to worker, not through the caller)."""
        return self.run(fn, *args, **kwargs)


class InProcess(WorkerRunner):
    """A plain worker object in this process (RolloutWorker, TrainWorker or a TrainBackend)."""

    def __init__(self, worker: Any):
        self.worker = worker

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return fn(self.worker, *args, **kwargs)


def as_runner(obj: Any) -> WorkerRunner:
    return obj if isinstance(obj, WorkerRunner) else InProcess(obj)


# ---- functions that run inside the workers (module level: Ray pickles them by reference) ----------


def _module(obj: Any, fault: str) -> torch.nn.Module:
    if not isinstance(obj, HoldsModule):
        raise TypeError(f"fault {fault}: {type(obj).__name__} has no torch module to modify")
    return obj.model


def _reference_module(backend: Any) -> torch.nn.Module | None:
    """The frozen reference when it is a second module (torch backend), else None (megatron: a host copy)."""
    return backend.ref_model if isinstance(backend, ModuleReference) else None


def engine_describe(worker: RolloutWorker) -> dict[str, Any]:
    info = dataclasses.asdict(worker.describe())
    return {
        "backend": info.get("backend", "?"),
        "model": info.get("model", "?"),
        "weight_version": int(worker.engine.weight_version),
        "dtype": worker.rollout_cfg.dtype,
        "device": worker.rollout_cfg.device,
    }


def trainer_describe(worker: Any) -> dict[str, Any]:
    backend = backend_of(worker)
    return {
        "backend": backend.name,
        "dtype": backend.optim_cfg.dtype,
        "device": backend.optim_cfg.device,
        "temperature": float(backend.temperature),
    }


def engine_scramble(worker: Any, mode: str, seed: int) -> None:
    scramble_module(_module(worker.engine, "gibberish_weights"), mode, seed)  # type: ignore[arg-type]


def trainer_scramble(worker: Any, mode: str, seed: int) -> None:
    backend = backend_of(worker)
    scramble_module(_module(backend, "gibberish_weights"), mode, seed)  # type: ignore[arg-type]
    ref = _reference_module(backend)
    if ref is not None:  # the reference is the starting policy: gibberish too
        scramble_module(ref, mode, seed)  # type: ignore[arg-type]
    elif isinstance(backend, HostReference):  # megatron: the reference is a host copy of the weights
        backend.reset_reference()


def trainer_perturb_ref(worker: Any, std: float, seed: int) -> None:
    backend = backend_of(worker)
    tensors = backend.reference_tensors() if isinstance(backend, HostReference) else None
    if tensors is not None:  # megatron: the reference's host copies
        perturb_tensors(tensors.values(), std, seed)
    elif (ref := _reference_module(backend)) is not None:
        perturb_module(ref, std, seed)
    else:
        raise TypeError(f"fault perturb_ref_std: {type(backend).__name__} keeps no reference model to perturb")


def engine_rollout(
    worker: RolloutWorker, rollout_id: int, temperature: float | None = None
) -> tuple[list[Sample], dict[str, Any]]:
    """One training rollout of the worker's prompt source, plus the text figures of check 1."""
    params = worker.rollout_cfg.sampling(rollout_id)
    if temperature is not None:  # fault injection: the engine's temperature differs from the trainer's
        params = dataclasses.replace(params, temperature=temperature)
    if worker.stop_token_ids:  # the model's extra stop ids (generation_config)
        params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + worker.stop_token_ids)
    items = prompts_for(worker.data_cfg, rollout_id, "train")
    samples = generate_samples(worker.engine, worker.tokenizer, items, params, worker.rollout_cfg.n_samples_per_prompt)
    return samples, response_stats(worker.tokenizer, samples, answer_format(worker.data_cfg))


def precision_algo(algo: AlgoConfig) -> AlgoConfig:
    """The algo the checks train with: the run's, except ppo, whose advantages come from a critic actor the
    checks do not start. Step-1 exactness (ppo_kl 0, clipfrac 0) holds for any advantages, so grpo stands in."""
    if algo.advantage_estimator != "ppo":
        return algo
    return algo.model_copy(update={"advantage_estimator": "grpo", "gamma": 1.0, "lambd": 1.0})


def trainer_first_step(
    worker: Any,
    samples: list[Sample],
    algo: Any,
    group_size: int,
    perturb_policy_std: float,
    seed: int,
    worst_samples: int,
) -> dict[str, Any]:
    return first_step_figures(
        backend_of(worker),
        samples,
        algo,
        group_size=group_size,
        perturb_policy_std=perturb_policy_std,
        seed=seed,
        worst_samples=worst_samples,
    )


def trainer_step(worker: Any, samples: list[Sample], algo: Any, group_size: int) -> dict[str, float]:
    return train_step_figures(backend_of(worker), samples, algo, group_size=group_size)


def trainer_named_weights(worker: Any) -> dict:
    return backend_of(worker).named_weights()


def trainer_checksums(worker: Any, cast_to: str | None = None) -> dict[str, str]:
    """Checksums of the trainer's tensors; floating ones cast to `cast_to` first (the engine's dtype,
    when it keeps its weights in another precision than the trainer: what the engine should hold)."""
    named = backend_of(worker).named_weights()
    if cast_to is not None:
        dtype = getattr(torch, cast_to)
        named = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in named.items()}
    return checksums(named)


def engine_receive(
    worker: Any, named: dict, weight_version: int, fault: str | None = None, tensor: str | None = None
) -> str | None:
    """Load the trainer's weights into the engine; `fault` corrupts them in transit first."""
    done = None
    if fault:
        named, done = apply_sync_fault(named, fault, tensor)  # type: ignore[arg-type]
    worker.engine.update_weights(named, weight_version)
    return done


def engine_checksums(worker: Any) -> dict[str, str]:
    return checksums(worker.engine.named_weights())


def engine_float_dtype(worker: Any) -> str | None:
    """The one floating dtype of the engine's weights (None when mixed or none)."""
    dtypes = {
        str(v.dtype).removeprefix("torch.") for v in worker.engine.named_weights().values() if v.is_floating_point()
    }
    return dtypes.pop() if len(dtypes) == 1 else None


def worker_peak_memory(worker: Any) -> dict[str, Any]:
    return peak_memory()


# ---- the checks -------------------------------------------------------------------------------------


def _attempt(phase: Phase, name: str, fn: Callable[[], T]) -> tuple[T | None, str | None]:
    try:
        return phase(name, fn), None
    except Exception as exc:  # noqa: BLE001 - a failing phase becomes a failing check, with its error
        tb = traceback.extract_tb(exc.__traceback__)
        where = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
        return None, f"{type(exc).__name__}: {exc}{where}"


def _not_run(name: str, why: str) -> CheckResult:
    return CheckResult(name, FAIL, {}, f"not run: {why}")


def _finite(*values: Any) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def step2_check(
    *,
    expected_version: int,
    engine_version: int | None,
    sample_versions: list[int],
    metrics: dict[str, float] | None,
    peaks: dict[str, dict[str, Any]],
    thr: AlignmentThresholds,
    error: str | None = None,
) -> CheckResult:
    figures: dict[str, Any] = {
        "expected_weight_version": expected_version,
        "engine_weight_version": engine_version,
        "sample_weight_versions": sample_versions,
    }
    m = metrics or {}
    for key in (
        "rollout/raw_reward",
        "train/loss",
        "train/grad_norm",
        "train/train_rollout_logprob_abs_diff",
        "rollout/kl",
    ):
        if key in m:
            figures["step2_" + key.split("/", 1)[1]] = m[key]
    peak = 0.0
    seen_pids = set()
    for role, p in peaks.items():
        figures[f"{role}_rss_peak_mb"] = p.get("rss_peak_mb")
        if p.get("cuda_peak_mb") is not None:
            figures[f"{role}_cuda_peak_mb"] = p["cuda_peak_mb"]
        seen_pids.add(p.get("pid"))
        peak = max(peak, p.get("rss_peak_mb") or 0.0, p.get("cuda_peak_mb") or 0.0)
    if peaks:
        figures["peak_mb"] = peak
        figures["workers_share_a_process"] = len(seen_pids) < len(peaks)
    figures["memory_budget_mb"] = thr.memory_budget_mb

    problems, causes = [], []
    if error is not None:
        problems.append(f"iteration 2 raised {error}")
        causes += LOAD_CAUSES
    else:
        if engine_version != expected_version or set(sample_versions) != {expected_version}:
            problems.append(
                f"iteration 2 did not run on the updated weights: engine at weight_version "
                f"{engine_version}, samples at {sample_versions}, expected {expected_version}"
            )
            causes += LOAD_CAUSES
        if not _finite(m.get("train/loss"), m.get("train/grad_norm")):
            problems.append(
                f"iteration 2 metrics not finite: loss {m.get('train/loss')}, grad_norm {m.get('train/grad_norm')}"
            )
            causes += LOAD_CAUSES
    if thr.memory_budget_mb is not None and peaks and peak > thr.memory_budget_mb:
        problems.append(f"peak memory {peak:.0f} MB above the budget of {thr.memory_budget_mb:g} MB")
        causes += MEMORY_CAUSES
    # Headline first: the memory figures, then the load figures.
    head = ("peak_mb", "memory_budget_mb", "engine_weight_version", "sample_weight_versions")
    figures = {**{k: figures[k] for k in head if k in figures}, **figures}
    if problems:
        return CheckResult(STEP2, FAIL, figures, "; ".join(problems), list(dict.fromkeys(causes)))
    budget = f" (budget {thr.memory_budget_mb:g} MB)" if thr.memory_budget_mb is not None else " (no budget set)"
    return CheckResult(
        STEP2, PASS, figures, f"iteration 2 ran on weight_version {expected_version}; peak memory {peak:.0f} MB{budget}"
    )


def run_alignment(
    rollout_worker: Any,
    trainer: Any,
    cfg: Any,
    *,
    thresholds: AlignmentThresholds | None = None,
    memory_budget_mb: float | None = None,
    faults: AlignmentFaults | None = None,
    name_map: NameMap | None = None,
    call_phase: Phase | None = None,
) -> AlignmentReport:
    """Run the six alignment checks on fresh workers (engine and trainer at the same starting weights).

    `rollout_worker`: a `RolloutWorker` (or a `WorkerRunner` around one); `trainer`: a `TrainWorker` or
    a `TrainBackend` (or a runner). `cfg`: a RunConfig (any object with `.run`, `.model.path`,
    `.rollout`, `.data`, `.algo`). `memory_budget_mb` overrides `thresholds.memory_budget_mb`.
    `call_phase(name, fn)` wraps each phase (the flow makes them Prefect tasks). The workers are
    changed (one optimizer step, one weight update, two rollouts): use them for nothing else after.
    """
    thr = thresholds or AlignmentThresholds()
    if memory_budget_mb is not None:
        thr = thr.model_copy(update={"memory_budget_mb": memory_budget_mb})
    faults = faults or AlignmentFaults()
    engine, train = as_runner(rollout_worker), as_runner(trainer)
    phase: Phase = call_phase or (lambda _name, fn: fn())
    started = time.perf_counter()
    group = cfg.rollout.n_samples_per_prompt
    reward_fn = reward_fn_from_config(cfg.rollout)
    algo = precision_algo(cfg.algo)

    eng = engine.run(engine_describe)
    trn = train.run(trainer_describe)
    context: dict[str, Any] = {
        "run": cfg.run,
        "created_at": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "model": cfg.model.path,
        "engine": f"{eng['backend']} {eng['dtype']} {eng['device']}",
        "trainer": f"{trn['backend']} {trn['dtype']} {trn['device']}",
        "samples": f"{cfg.data.prompts_per_rollout} prompts x {group}",
        "rollout_temperature": cfg.rollout.temperature,
        "rollout_logprobs": cfg.rollout.logprobs,
        "trainer_temperature": trn["temperature"],
        "thresholds": thr.model_dump(),
        "faults": faults.describe(),
    }
    if algo is not cfg.algo:
        context["advantage_estimator"] = (
            f"grpo (the run's {cfg.algo.advantage_estimator} needs its critic actor; "
            "the precision checks do not depend on the advantages)"
        )

    # Faults that exist before anything runs (the model, the reference).
    if faults.gibberish_weights:
        engine.run(engine_scramble, faults.gibberish_weights, faults.seed)
        train.run(trainer_scramble, faults.gibberish_weights, faults.seed)
    if faults.perturb_ref_std > 0:
        train.run(trainer_perturb_ref, faults.perturb_ref_std, faults.seed)

    def score(samples: list[Sample]) -> list[Sample]:
        return score_samples(samples, reward_fn, reward_key=cfg.rollout.reward_key)

    def finish(checks: list[CheckResult]) -> AlignmentReport:
        context["duration_s"] = round(time.perf_counter() - started, 2)
        return AlignmentReport(checks=checks, context=context)

    # ---- step 1: one rollout, scored by policy and reference, one optimizer step -------------------
    def rollout_1() -> tuple[list[Sample], dict[str, Any]]:
        samples, stats = engine.run(engine_rollout, 0, faults.engine_temperature)
        return score(samples), stats

    first, err = _attempt(phase, "rollout-1", rollout_1)
    if err is not None:
        why = f"the first rollout raised {err}"
        return finish(
            [
                CheckResult(
                    COHERENCE,
                    FAIL,
                    {},
                    why,
                    ["the engine could not generate or the reward function failed: see the error"],
                ),
                *[_not_run(n, why) for n in CHECK_NAMES[1:]],
            ]
        )
    samples, stats = first
    reward_mean = sum(s.scalar_reward() for s in samples) / len(samples)
    figs, err = _attempt(
        phase,
        "train-step-1",
        lambda: train.run(
            trainer_first_step, samples, algo, group, faults.perturb_policy_std, faults.seed, thr.worst_samples
        ),
    )

    checks = [coherence_check(stats, figs["ref"]["ref_nll"] if figs else None, thr, reward_mean=reward_mean)]
    if figs is None:
        checks += [CheckResult(n, FAIL, {}, f"the first train step raised {err}", []) for n in CHECK_NAMES[1:5]]
    else:
        checks += [
            ref_equal_check(figs, thr),
            mismatch_check(
                figs,
                thr,
                engine=context["engine"],
                trainer=context["trainer"],
                expect_bitwise=context["rollout_logprobs"] == "teacher_forced",
            ),
            mismatch_kl_check(figs, thr),
            first_step_check(figs, thr),
        ]

    # ---- sync: trainer -> engine, then every tensor compared ---------------------------------------
    version = eng["weight_version"] + 1
    transit, err = _attempt(
        phase,
        "sync",
        lambda: engine.run(
            engine_receive, train.defer(trainer_named_weights), version, faults.sync, faults.sync_tensor
        ),
    )
    parity, compared_in = None, None
    if err is None:

        def parity_phase():
            dtype = engine.run(engine_float_dtype)
            cast = dtype if dtype is not None and dtype != trn["dtype"] else None
            return compare(train.run(trainer_checksums, cast), engine.run(engine_checksums), name_map), dtype

        result, err = _attempt(phase, "parity", parity_phase)
        if result is not None:
            parity, compared_in = result
    checks.append(sync_check(parity, weight_version=version, error=err, transit=transit, compared_in=compared_in))

    # ---- step 2: the updated weights generate and train once more; peak memory -----------------------
    def step2() -> tuple[int, list[int], dict[str, float]]:
        samples2, _ = engine.run(engine_rollout, 1, faults.engine_temperature)
        score(samples2)
        metrics = train.run(trainer_step, samples2, algo, group)
        return engine.run(engine_describe)["weight_version"], sorted({s.weight_version for s in samples2}), metrics

    second, err = _attempt(phase, "iteration-2", step2)
    peaks, _ = _attempt(
        phase,
        "peak-memory",
        lambda: {"engine": engine.run(worker_peak_memory), "trainer": train.run(worker_peak_memory)},
    )
    engine_version, sample_versions, metrics = second if second is not None else (None, [], None)
    checks.append(
        step2_check(
            expected_version=version,
            engine_version=engine_version,
            sample_versions=sample_versions,
            metrics=metrics,
            peaks=peaks or {},
            thr=thr,
            error=err,
        )
    )
    return finish(checks)


class AlignmentRun(Protocol):
    """What building the alignment workers reads of a run's config (flows' RunConfig has it; tasks/ does not
    import flows/, docs/architecture.md)."""

    run: str
    model: Any  # .path, .lora
    store: Any  # .root
    rollout: RolloutConfig
    data: DataConfig
    train: OptimConfig
    algo: AlgoConfig

    def scoring_layout(self) -> Optional[ScoringLayout]: ...

    def compile_cache_uri(self) -> Optional[str]: ...


def alignment_workers(cfg: AlignmentRun) -> tuple[Any, Any]:
    """Fresh `RolloutWorker` + `TrainWorker` for `cfg`, trainer at one optimizer step per rollout. They load
    and save torch.compile's caches where the run's workers do (store.compile_cache)."""
    optim = cfg.train.model_copy(update={"num_steps_per_rollout": 1})
    cache = cfg.compile_cache_uri()
    rollout = RolloutWorker(cfg.model.path, cfg.rollout, cfg.data, scoring=cfg.scoring_layout(), compile_cache=cache)
    trainer = TrainWorker(
        cfg.model.path,
        optim,
        cfg.algo,
        store_root=cfg.store.root,
        run=cfg.run,
        temperature=cfg.rollout.temperature or 1.0,
        lora=cfg.model.lora,
        compile_cache=cache,
    )
    return rollout, trainer


def refuse_faults_it_cannot_take(cfg: AlignmentRun, faults: AlignmentFaults | None) -> None:
    """ValueError, one line naming the field, when `faults` cannot act on `cfg`'s trainer; before any worker."""
    refused = faults.refusal(lora=cfg.model.lora is not None) if faults is not None else None
    if refused:
        raise ValueError(refused)


def run_alignment_local(cfg: AlignmentRun, **kwargs: Any) -> AlignmentReport:
    """Build the workers in this process (no Prefect, no Ray) and run the checks: a GPU box with torch
    is enough (set rollout.device / train.device to cuda)."""
    refuse_faults_it_cannot_take(cfg, kwargs.get("faults"))
    rollout, trainer = alignment_workers(cfg)
    return run_alignment(rollout, trainer, cfg, **kwargs)


__all__ = [
    "CHECK_NAMES",
    "STEP2",
    "AlignmentFaults",
    "AlignmentReport",
    "AlignmentRun",
    "AlignmentThresholds",
    "CheckResult",
    "InProcess",
    "WorkerRunner",
    "alignment_workers",
    "as_runner",
    "run_alignment",
    "refuse_faults_it_cannot_take",
    "run_alignment_local",
    "step2_check",
]
