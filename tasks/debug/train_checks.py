"""Checks 2-4 (slime's debug.md step 1), trainer side.

`first_step_figures` runs where the trainer's tensors live: it scores one rollout with the policy
and the reference (the same teacher-forced forward), takes exactly one optimizer step on it and
returns small JSON-able figures. The `*_check` functions judge those figures.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from rollflow.artifacts.sample import Sample
from rollflow.tasks.debug.checks import FAIL, PASS, WARN, AlignmentThresholds, CheckResult
from rollflow.tasks.debug.faults import perturb_module
from rollflow.tasks.train.losses import masked_mean
from rollflow.tasks.train.settings import AlgoConfig
from rollflow.tasks.train.step import TrainBackend, prepare_batch, train_on_samples
from rollflow.tasks.train.worker import TrainWorker

REF_EQUAL, MISMATCH, FIRST_STEP = "step1_logprob_equals_ref", "train_rollout_logprob_diff", "one_step_update"
MISMATCH_KL = "train_rollout_kl"

REF_NOT_EQUAL_CAUSES = [
    "non-deterministic kernels: atomics / split-K reductions, a non-deterministic attention backend; enable "
    "deterministic algorithms (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG)",
    "the policy and reference forwards differ: attention backend (sdpa / eager / flash), dtype, padding, "
    "position ids, micro-batch split or thread count",
    "the reference model is not the initial policy: different weights loaded into ref, or ref updated",
]
REF_LEVEL_CAUSES = [
    "chat template: applied to a pretrain model, missing for an instruct model, or tokenized twice",
    "data distribution: prompts unlike what the model was trained on (the model is not at home here)",
    "responses not produced by this model (the engine runs another checkpoint)",
]
MISMATCH_CAUSES = [
    "temperature applied differently: the engine samples / scores at one temperature, the trainer divides "
    "logits by another (rollout.temperature vs the trainer's)",
    "different numerics in the engine: dtype (bfloat16 / float16 vs float32), attention kernels, fused ops",
    "engine log-probs taken after logits processors (top-k / top-p / repetition penalty) instead of raw logits",
    "engine weights differ from the trainer's (sync not applied, stale weight_version)",
    "tokens misaligned between engine and trainer (BOS / chat template tokenized twice, response offset)",
]
STEP_CAUSES = [
    "the policy changed between computing the old log-probs and the first step (a weight load, sync or "
    "optimizer step in between)",
    "the training forward differs from the scoring forward: dropout / train mode, micro-batch split, padding, "
    "dtype or attention backend",
    "non-deterministic kernels in the training forward",
]
GRAD_CAUSES = [
    "learning rate / loss scale too large, loss summed instead of averaged, advantages not normalized",
]


def backend_of(worker: TrainWorker | TrainBackend) -> TrainBackend:
    """A TrainWorker's backend, or the object itself when it is a backend."""
    return worker.backend if isinstance(worker, TrainWorker) else worker


@contextlib.contextmanager
def one_optimizer_step(backend: TrainBackend) -> Iterator[None]:
    """Make `backend.train` take exactly one optimizer step (num_steps_per_rollout = 1)."""
    optim = backend.optim_cfg
    if optim.num_steps_per_rollout == 1:
        yield
        return
    backend.optim_cfg = optim.model_copy(update={"num_steps_per_rollout": 1})
    try:
        yield
    finally:
        backend.optim_cfg = optim


def first_step_figures(
    backend: Any,
    samples: list[Sample],
    algo: AlgoConfig,
    *,
    group_size: int,
    perturb_policy_std: float = 0.0,
    seed: int = 0,
    worst_samples: int = 5,
) -> dict[str, Any]:
    """Score `samples` (policy + reference), compare with the engine's log-probs, take one step."""
    backend = backend_of(backend)
    batch, metrics = prepare_batch(backend, samples, algo, group_size=group_size, compute_ref=True)
    mask = batch.response_mask
    on = mask > 0
    lp, ref, roll = batch.log_probs, batch.ref_log_probs, batch.rollout_log_probs
    figs: dict[str, Any] = {"n_tokens": int(on.sum()), "temperature": float(getattr(backend, "temperature", 1.0))}

    diff_ref = (lp - ref).abs()[on]
    figs["ref"] = {
        "equal": bool(torch.equal(lp[on], ref[on])),
        "n_unequal_tokens": int((lp[on] != ref[on]).sum()),
        "max_abs_diff": float(diff_ref.max()) if diff_ref.numel() else 0.0,
        "kl_mean": float(masked_mean(lp - ref, mask)),
        "mean_log_prob": float(masked_mean(lp, mask)),
        "mean_ref_log_prob": float(masked_mean(ref, mask)),
        "ref_nll": -float(masked_mean(ref, mask)),
    }

    diff = (lp - roll).abs() * mask
    mismatch_figures = {k.removeprefix("mismatch/"): v for k, v in metrics.items() if k.startswith("mismatch/")}
    per_row_max = diff.max(dim=1).values
    per_row_mean = diff.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    order = torch.argsort(per_row_max, descending=True)[:worst_samples].tolist()
    figs["mismatch"] = {
        # bitwise: rollout.logprobs='teacher_forced' (the engine ran this very forward) gives exactly 0
        "bitwise": bool(torch.equal(lp[on], roll[on])),
        "n_unequal_tokens": int((lp[on] != roll[on]).sum()),
        "mean_abs_diff": float(masked_mean(diff, mask)),
        "max_abs_diff": float(diff.max()) if diff.numel() else 0.0,
        "mean_train_log_prob": float(masked_mean(lp, mask)),
        "mean_rollout_log_prob": float(masked_mean(roll, mask)),
        "metrics": mismatch_figures,  # mismatch/* of tasks/train/mismatch.py (KL, chi-square, ESS, ppl)
        "worst_samples": [
            {
                "index": samples[i].index,
                "prompt": samples[i].prompt if isinstance(samples[i].prompt, str) else "<chat>",
                "response": samples[i].response,
                "max_abs_diff": float(per_row_max[i]),
                "mean_abs_diff": float(per_row_mean[i]),
            }
            for i in order
        ],
    }

    if perturb_policy_std > 0:  # fault injection: the policy moves after the old log-probs were taken
        perturb_module(backend.model, perturb_policy_std, seed)
    with one_optimizer_step(backend):
        train = backend.train(batch, algo)
    figs["step"] = {
        "ppo_kl": train.get("train/step1_ppo_kl", train.get("train/ppo_kl")),
        "pg_clipfrac": train.get("train/step1_pg_clipfrac", train.get("train/pg_clipfrac")),
        "grad_norm": train.get("train/step1_grad_norm", train.get("train/grad_norm")),
        "loss": train.get("train/loss"),
        "steps": 1,
    }
    figs["metrics"] = {k: v for k, v in {**metrics, **train}.items() if isinstance(v, float)}
    return figs


def train_step_figures(backend: Any, samples: list[Sample], algo: AlgoConfig, *, group_size: int) -> dict[str, Any]:
    """A plain train call (step 2): its metrics plus the sample weight versions it trained on."""
    result = train_on_samples(backend_of(backend), samples, algo, group_size=group_size, compute_ref=True)
    return {k: v for k, v in result.metrics.items() if isinstance(v, float)}


def ref_equal_check(figs: dict[str, Any], thr: AlignmentThresholds) -> CheckResult:
    ref = figs["ref"]
    figures = {
        "equal": ref["equal"],
        "kl_mean": ref["kl_mean"],
        "max_abs_diff": ref["max_abs_diff"],
        "mean_log_prob": ref["mean_log_prob"],
        "mean_ref_log_prob": ref["mean_ref_log_prob"],
        "n_unequal_tokens": ref["n_unequal_tokens"],
        "n_tokens": figs["n_tokens"],
        "expected_max_neg_log_prob": thr.expected_max_neg_log_prob,
    }
    exact_ok = ref["equal"] if thr.require_exact_ref_equality else ref["max_abs_diff"] <= thr.ref_abs_tolerance
    if not exact_ok:
        how = "exactly" if thr.require_exact_ref_equality else f"within {thr.ref_abs_tolerance:g}"
        return CheckResult(
            REF_EQUAL,
            FAIL,
            figures,
            f"step 1 log_probs != ref_log_probs ({how}): {ref['n_unequal_tokens']} of {figs['n_tokens']} tokens "
            f"differ, max |diff| {ref['max_abs_diff']:.3g}, kl {ref['kl_mean']:.3g}; the policy and the reference "
            "must be the same forward at step 1",
            list(REF_NOT_EQUAL_CAUSES),
        )
    level = -ref["mean_log_prob"]
    if not level <= thr.expected_max_neg_log_prob:
        return CheckResult(
            REF_EQUAL,
            WARN,
            figures,
            f"log_probs == ref_log_probs (kl 0), but the mean -log_prob {level:.3f} is above the expected "
            f"{thr.expected_max_neg_log_prob}",
            list(REF_LEVEL_CAUSES),
        )
    return CheckResult(
        REF_EQUAL,
        PASS,
        figures,
        f"log_probs == ref_log_probs exactly over {figs['n_tokens']} tokens (kl 0), mean log_prob "
        f"{ref['mean_log_prob']:.4f}",
    )


BITWISE_CAUSES = [
    "the trainer scored another batch than the engine's generate call: samples filtered, subsampled or "
    "reordered, or the rollout generated in several calls (the padding width and micro-batches then differ)",
    "engine weights differ from the trainer's (sync not applied, stale weight_version, a buffer such as RoPE "
    "inv_freq cast to another dtype on one side)",
    "another thread count, device or attention backend on one side, or non-deterministic kernels "
    "(torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8)",
    "temperature applied differently (the engine rescoring at the sampling temperature, the trainer at its own)",
]


def mismatch_check(
    figs: dict[str, Any], thr: AlignmentThresholds, *, engine: str = "", trainer: str = "", expect_bitwise: bool = False
) -> CheckResult:
    """Verdict 'bitwise' when every response token's log-prob is identical (max |diff| exactly 0.0), else
    'tolerance' (judged by the thresholds). `expect_bitwise` (rollout.logprobs='teacher_forced'): any
    difference fails."""
    mm = figs["mismatch"]
    bitwise = bool(mm.get("bitwise", mm["max_abs_diff"] == 0.0))
    figures = {
        "verdict": "bitwise" if bitwise else "tolerance",
        "mean_abs_diff": mm["mean_abs_diff"],
        "max_abs_diff": mm["max_abs_diff"],
        "mean_train_log_prob": mm["mean_train_log_prob"],
        "mean_rollout_log_prob": mm["mean_rollout_log_prob"],
        "n_tokens": figs["n_tokens"],
        "trainer_temperature": figs["temperature"],
    }
    if engine:
        figures["engine"] = engine
    if trainer:
        figures["trainer"] = trainer
    figures["worst_samples"] = mm["worst_samples"]
    mean, top = mm["mean_abs_diff"], mm["max_abs_diff"]
    if bitwise:
        return CheckResult(
            MISMATCH,
            PASS,
            figures,
            f"bitwise: train and rollout log-probs are identical over "
            f"{figs['n_tokens']} response tokens (max |diff| 0.0)",
        )
    text = f"mean |train - rollout| log-prob {mean:.3g}, max {top:.3g} over {figs['n_tokens']} response tokens"
    if expect_bitwise:
        return CheckResult(
            MISMATCH,
            FAIL,
            figures,
            f"rollout.logprobs='teacher_forced' promises bitwise equal log-probs, but "
            f"{mm.get('n_unequal_tokens', '?')} of {figs['n_tokens']} tokens differ: {text}",
            list(BITWISE_CAUSES),
        )
    if not (mean <= thr.mismatch_mean_fail and top <= thr.mismatch_max_fail):
        return CheckResult(
            MISMATCH,
            FAIL,
            figures,
            f"{text} (limits: mean {thr.mismatch_mean_fail:g}, max {thr.mismatch_max_fail:g})",
            list(MISMATCH_CAUSES),
        )
    if mean > thr.mismatch_mean_warn:
        return CheckResult(
            MISMATCH, WARN, figures, f"{text} (above the warn level {thr.mismatch_mean_warn:g})", list(MISMATCH_CAUSES)
        )
    return CheckResult(MISMATCH, PASS, figures, text)


def mismatch_kl_check(figs: dict[str, Any], thr: AlignmentThresholds) -> CheckResult:
    """The rollout-vs-train distribution gap on the sampled tokens: judged on ``k3_kl`` (an unbiased,
    per-token non-negative estimate of KL(rollout || train) under the engine's samples); the other
    mismatch metrics (k1 KL, log-ppl gap and ratio, chi-square, ESS) are reported beside it."""
    metrics = dict(figs["mismatch"].get("metrics") or {})
    if not metrics:
        return CheckResult(MISMATCH_KL, WARN, {}, "not judged: the rollout has no engine log-probs")
    kl = metrics["k3_kl"]
    text = (
        f"KL(rollout || train) {kl:.3g} (k3; k1 {metrics['kl']:.3g}), log-ppl gap {metrics['log_ppl_diff']:.3g}, "
        f"chi2 token {metrics['chi2_token']:.3g}, ESS {metrics['ess_token']:.3g}"
    )
    if not kl <= thr.mismatch_kl_fail:  # NaN fails too
        return CheckResult(
            MISMATCH_KL, FAIL, metrics, f"{text} (limit {thr.mismatch_kl_fail:g})", list(MISMATCH_CAUSES)
        )
    if kl > thr.mismatch_kl_warn:
        return CheckResult(
            MISMATCH_KL, WARN, metrics, f"{text} (above the warn level {thr.mismatch_kl_warn:g})", list(MISMATCH_CAUSES)
        )
    return CheckResult(MISMATCH_KL, PASS, metrics, text)


def _num(value: float | None) -> str:
    return "missing" if value is None else f"{value:.3g}"


def first_step_check(figs: dict[str, Any], thr: AlignmentThresholds) -> CheckResult:
    st = figs["step"]
    figures = {
        "ppo_kl": st["ppo_kl"],
        "pg_clipfrac": st["pg_clipfrac"],
        "grad_norm": st["grad_norm"],
        "loss": st["loss"],
        "steps": st["steps"],
        "max_grad_norm": thr.max_grad_norm,
    }
    problems, causes = [], []
    kl, clip, gn = st["ppo_kl"], st["pg_clipfrac"], st["grad_norm"]
    if kl is None or not abs(kl) <= thr.max_ppo_kl:
        problems.append(
            f"ppo_kl {_num(kl)} != 0" if thr.max_ppo_kl == 0 else f"|ppo_kl| {_num(kl)} > {thr.max_ppo_kl:g}"
        )
    if clip is None or not clip <= thr.max_pg_clipfrac:
        problems.append(f"pg_clipfrac {_num(clip)} > {thr.max_pg_clipfrac:g}")
    if problems:
        causes += STEP_CAUSES
    if gn is None or not gn <= thr.max_grad_norm:
        problems.append(f"grad_norm {_num(gn)} > {thr.max_grad_norm:g}")
        causes += GRAD_CAUSES
    if problems:
        return CheckResult(
            FIRST_STEP, FAIL, figures, "first step on its own rollout is not on-policy: " + "; ".join(problems), causes
        )
    return CheckResult(
        FIRST_STEP, PASS, figures, f"one rollout, one step: ppo_kl {kl:g}, pg_clipfrac {clip:g}, grad_norm {gn:.4g}"
    )
