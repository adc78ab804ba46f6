"""Loss numerics at parity with slime/verl (issue 18): GSPO, overflow guards, mismatch correction and
metrics, loss aggregation modes, REINFORCE++ over masked spans, skipped non-finite steps.

Expected values are worked by hand in the comments (or, for GSPO, computed from the paper's
sequence-level formula written out independently here).
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from rollflow.artifacts.sample import Sample
from rollflow.tasks.train.advantages import compute_advantages
from rollflow.tasks.train.batch import batch_from_samples
from rollflow.tasks.train.losses import policy_loss
from rollflow.tasks.train.mismatch import correction, effective_sample_size, mismatch_metrics
from rollflow.tasks.train.objective import Denominators, aggregate, micro_batch_objective, minibatch_steps
from rollflow.tasks.train.settings import AlgoConfig
from rollflow.tasks.train.step import prepare_batch

F64 = torch.float64
LN2 = math.log(2.0)


def t(*values, dtype=F64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def close(actual, expected, tol=1e-12) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64), rtol=tol, atol=tol
    )


# ------------------------------------------------------------------------------------------------ GSPO


def _gspo_inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    B, T = 6, 7
    old = -torch.rand(B, T, generator=gen, dtype=F64) * 3
    new = (old + torch.randn(B, T, generator=gen, dtype=F64) * 0.25).requires_grad_(True)
    mask = (torch.rand(B, T, generator=gen) > 0.3).to(F64)
    mask[:, 0] = 1  # every sample has a loss token
    adv = torch.randn(B, 1, generator=gen, dtype=F64).expand(B, T).contiguous()
    return new, old, mask, adv


def _published_gspo_loss(new, old, mask, adv, eps_low, eps_high):
    """-J_GSPO = -(1/G) sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i),
    s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|) = exp(mean over y_i's tokens of (log pi - log pi_old))."""
    n = mask.sum(dim=1)
    s = torch.exp(((new - old) * mask).sum(dim=1) / n)
    a = adv[:, 0]
    return -torch.minimum(s * a, s.clamp(1 - eps_low, 1 + eps_high) * a).mean(), s


def test_gspo_matches_the_published_sequence_objective_in_loss_and_gradient() -> None:
    new, old, mask, adv = _gspo_inputs()
    eps_low, eps_high = 0.1, 0.12
    ref_loss, s = _published_gspo_loss(new, old, mask, adv, eps_low, eps_high)
    # the inputs exercise both branches: some sequences clipped, some not
    clipped = (s < 1 - eps_low) | (s > 1 + eps_high)
    assert clipped.any() and (~clipped).any()
    (ref_grad,) = torch.autograd.grad(ref_loss, new)

    terms = policy_loss(new, old, adv, eps_clip=eps_low, eps_clip_high=eps_high, mask=mask, level="sequence")
    denom = Denominators(tokens=float(mask.sum()), rows=float(mask.shape[0]), width=float(mask.shape[1]))
    ours = aggregate(terms.loss, mask, denom, "seq-mean-token-mean")
    (our_grad,) = torch.autograd.grad(ours, new)
    assert abs(float((ours - ref_loss).detach())) < 1e-6
    assert float((our_grad - ref_grad).abs().max()) < 1e-6
    # every token of a sample carries the sequence ratio
    on = mask > 0
    close(terms.ratio.detach()[on], s.detach()[:, None].expand_as(mask)[on])


def test_gspo_differs_from_grpo_in_loss_and_gradient() -> None:
    new, old, mask, adv = _gspo_inputs(seed=1)
    denom = Denominators(tokens=float(mask.sum()), rows=float(mask.shape[0]), width=float(mask.shape[1]))
    losses, grads = [], []
    for level in ("sequence", "token"):
        terms = policy_loss(new, old, adv, eps_clip=0.2, mask=mask, level=level)
        loss = aggregate(terms.loss, mask, denom, "token-mean")
        losses.append(float(loss.detach()))
        grads.append(torch.autograd.grad(loss, new)[0])
    assert abs(losses[0] - losses[1]) > 1e-4
    assert float((grads[0] - grads[1]).abs().max()) > 1e-4


def test_gspo_is_selected_by_the_estimator_in_the_objective() -> None:
    batch = _toy_batch()
    new = (
        batch.log_probs
        + 0.3 * torch.sin(torch.arange(batch.log_probs.numel(), dtype=torch.float32)).reshape(batch.log_probs.shape)
    ).requires_grad_(True)
    entropy = torch.zeros_like(new)
    denom = Denominators.of(batch)
    out = {}
    for est in ("grpo", "gspo"):
        loss, _ = micro_batch_objective(new, entropy, batch, AlgoConfig(advantage_estimator=est), denom)
        out[est] = (float(loss.detach()), torch.autograd.grad(loss, new)[0])
    assert out["grpo"][0] != out["gspo"][0]
    assert not torch.equal(out["grpo"][1], out["gspo"][1])


def test_gspo_defaults_are_the_papers_objective() -> None:
    """AlgoConfig(advantage_estimator='gspo') alone trains the published objective: clip ranges 3e-4 / 4e-4
    and the mean over sequences (token-mean would weight the 3-token sample over the 2-token one)."""
    batch = _toy_batch()  # two samples of 3 and 2 loss tokens, advantages +1 / -1
    mask = batch.response_mask.to(F64)
    drift = torch.tensor([[0.002], [-0.0001]])  # sequence ratios exp(0.002) (clipped) and exp(-1e-4) (inside)
    new = (batch.log_probs + drift * batch.response_mask).requires_grad_(True)
    loss, stats = micro_batch_objective(
        new, torch.zeros_like(new), batch, AlgoConfig(advantage_estimator="gspo"), Denominators.of(batch)
    )
    adv = ((batch.advantages * mask).sum(dim=1) / mask.sum(dim=1))[:, None]  # the published form: one per sample
    ref, s = _published_gspo_loss(new.to(F64), batch.log_probs.to(F64), mask, adv, eps_low=3e-4, eps_high=4e-4)
    s = s.detach()
    assert float(s[0]) > 1 + 4e-4 and 1 - 3e-4 < float(s[1]) < 1
    assert abs(float(loss.detach()) - float(ref.detach())) < 1e-6
    close(stats["pg_clipfrac"], 3 / 5, tol=1e-6)  # sample 0's three tokens of the five
    (grad,) = torch.autograd.grad(loss, new)
    assert float(grad[0].abs().max()) == 0.0 and float(grad[1].abs().max()) > 0  # clipped: no gradient


# ------------------------------------------------------------------------------------- overflow guards


def _toy_samples(loss_masks=((1, 1, 1), (1, 1, 0))) -> list[Sample]:
    out = []
    for i, lm in enumerate(loss_masks):
        response = [3 + (i + j) % 5 for j in range(len(lm))]
        out.append(
            Sample(
                group_index=0,
                index=i,
                prompt="p",
                tokens=[1, 2] + response,
                response="r",
                response_length=len(response),
                loss_mask=list(lm),
                rollout_log_probs=[-1.0] * len(response),
                reward=float(i),
            )
        )
    return out


def _toy_batch(loss_masks=((1, 1, 1), (1, 1, 0))):
    batch = batch_from_samples(_toy_samples(loss_masks), group_size=len(loss_masks))
    gen = torch.Generator().manual_seed(3)
    batch.log_probs = -torch.rand(batch.response_mask.shape, generator=gen)
    batch.ref_log_probs = batch.log_probs.clone()
    batch.advantages = torch.where(batch.response_mask > 0, torch.tensor([[1.0], [-1.0]]), torch.zeros(()))
    return batch


def test_masked_token_with_log_ratio_95_keeps_loss_and_gradient_finite() -> None:
    batch = _toy_batch()
    masked = (batch.response_mask == 0).nonzero()[0]  # a prompt/padding slot
    batch.log_probs[tuple(masked)] = -95.0  # old; the new log-prob there is 0: log-ratio +95
    new = batch.log_probs.clone()
    new[tuple(masked)] = 0.0
    new.requires_grad_(True)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        loss, stats = micro_batch_objective(
            new, torch.zeros_like(new), batch, AlgoConfig(loss_agg_mode=agg), Denominators.of(batch)
        )
        (grad,) = torch.autograd.grad(loss, new)
        assert math.isfinite(float(loss)) and torch.isfinite(grad).all(), agg
        assert grad[tuple(masked)] == 0


def test_loss_token_log_ratio_95_is_clamped_and_counted() -> None:
    batch = _toy_batch()
    on = (batch.response_mask > 0).nonzero()[0]
    batch.log_probs[tuple(on)] = -95.0
    new = batch.log_probs.clone()
    new[tuple(on)] = 0.0
    new.requires_grad_(True)
    loss, stats = micro_batch_objective(new, torch.zeros_like(new), batch, AlgoConfig(), Denominators.of(batch))
    assert math.isfinite(float(loss))
    assert torch.isfinite(torch.autograd.grad(loss, new)[0]).all()
    # 1 of the 5 loss tokens hit the +-20 clamp
    close(stats["ratio_clampfrac"], 0.2, tol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_k3_kl_loss_at_log_ratio_minus_94_is_finite(dtype) -> None:
    batch = _toy_batch()
    on = (batch.response_mask > 0).nonzero()[0]
    batch.ref_log_probs[tuple(on)] = -0.5
    new = batch.log_probs.clone()
    new[tuple(on)] = -94.5  # log pi - log pi_ref = -94: e^94 is inf in fp32
    new = new.to(dtype).requires_grad_(True)
    algo = AlgoConfig(kl_loss_coef=0.1, kl_loss_type="k3")
    loss, stats = micro_batch_objective(new, torch.zeros_like(new), batch, algo, Denominators.of(batch))
    (grad,) = torch.autograd.grad(loss, new)
    assert math.isfinite(float(loss)) and math.isfinite(stats["kl_loss"])
    assert torch.isfinite(grad).all()


# -------------------------------------------------------------------------------- loss aggregation


def _agg_inputs(dtype=F64):
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=dtype)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], dtype=dtype)  # row 2 fully masked
    return values, mask, Denominators(tokens=5.0, rows=3.0, width=3.0)


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16])
def test_aggregation_modes_hand_worked(dtype) -> None:
    values, mask, denom = _agg_inputs(dtype)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    # masked token sums: row0 1+2 = 3, row1 4+5+6 = 15, row2 none; 5 tokens, 3 samples
    close(aggregate(values, mask, denom, "token-mean"), 18 / 5, tol)
    # per-sample means 1.5, 5 and 0 (the fully masked sample still counts: / 3, as slime)
    close(aggregate(values, mask, denom, "seq-mean-token-mean"), (1.5 + 5.0) / 3, tol)
    close(aggregate(values, mask, denom, "seq-mean-token-sum"), 18 / 3, tol)
    # Dr. GRPO: token sums over a constant: / (3 samples * 4)
    close(aggregate(values, mask, denom, "seq-mean-token-sum-norm", norm=4), 18 / 12, tol)
    close(aggregate(values, mask, denom, "seq-mean-token-sum-norm"), 18 / 9, tol)  # default: the width
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(values, mask, denom, "sum")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_aggregation_shares_add_up_over_micro_batches(mode) -> None:
    values, mask, denom = _agg_inputs()
    whole = aggregate(values, mask, denom, mode)
    parts = sum(aggregate(values[i : i + 1], mask[i : i + 1], denom, mode) for i in range(3))
    close(parts, whole)


def test_nan_in_a_masked_slot_does_not_reach_the_sum() -> None:
    values, mask, denom = _agg_inputs()
    values[2, 0] = float("nan")
    values[0, 2] = float("inf")
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        assert math.isfinite(float(aggregate(values, mask, denom, mode)))


# ----------------------------------------------------------------------------- mismatch correction


def _ratios():
    # one sample, r = old - rollout = [ln 2, 0, -ln 2]: token ratios [2, 1, 0.5]; a padding slot
    old = t(LN2, 0.0, -LN2, 0.0)[None]
    rollout = torch.zeros_like(old)
    mask = t(1, 1, 1, 0)[None]
    return old, rollout, mask


def test_mismatch_metrics_hand_worked() -> None:
    old, rollout, mask = _ratios()
    m = mismatch_metrics(old, rollout, mask)
    close(m["mismatch/kl"], 0.0)  # mean(rollout - old) = 0
    # k3 = mean(e^r - r - 1) = ((2 - ln2 - 1) + 0 + (0.5 + ln2 - 1)) / 3 = 1/6
    close(m["mismatch/k3_kl"], 1 / 6)
    close(m["mismatch/chi2_token"], (4 + 1 + 0.25) / 3 - 1)  # mean(rho^2) - 1 = 0.75
    close(m["mismatch/chi2_seq"], 0.0)  # (prod rho)^2 - 1 = 1 - 1
    close(m["mismatch/tis"], 3.5 / 3)  # raw mean ratio, unbounded
    close(m["mismatch/ess_token"], 3.5**2 / (3 * 5.25))
    close(m["mismatch/training_log_ppl"], 0.0)
    close(m["mismatch/log_ppl_diff"], 0.0)
    close(m["mismatch/max_abs_log_ratio"], LN2)
    # a uniform shift: old = rollout - 0.1 everywhere -> log_ppl_diff = 0.1, ppl_ratio = e^0.1
    m = mismatch_metrics(
        torch.full((2, 3), -1.1, dtype=F64), torch.full((2, 3), -1.0, dtype=F64), torch.ones(2, 3, dtype=F64)
    )
    close(m["mismatch/log_ppl_diff"], 0.1)
    close(m["mismatch/ppl_ratio"], math.exp(0.1))
    close(m["mismatch/kl"], 0.1)
    close(m["mismatch/ess_token"], 1.0)


def test_mismatch_metrics_identical_inputs_are_exactly_zero() -> None:
    lp = -torch.rand(3, 5)
    m = mismatch_metrics(lp, lp.clone(), torch.ones(3, 5))
    for key in ("kl", "k3_kl", "chi2_token", "chi2_seq", "log_ppl_diff", "log_ppl_abs_diff", "max_abs_log_ratio"):
        assert m[f"mismatch/{key}"] == 0.0, key
    assert m["mismatch/tis"] == 1.0 and m["mismatch/ess_token"] == 1.0


def test_is_weights_token_modes() -> None:
    old, rollout, mask = _ratios()
    fix = correction(old, rollout, mask, AlgoConfig(use_tis=True, tis_upper_bound=1.5))  # truncate
    close(fix.weights[0], t(1.5, 1.0, 0.5, 0.0))
    close(fix.metrics["mismatch/tis_clipfrac"], 1 / 3)
    assert torch.equal(fix.keep, mask.float())
    fix = correction(
        old, rollout, mask, AlgoConfig(use_tis=True, tis_mode="clip", tis_lower_bound=0.8, tis_upper_bound=1.5)
    )
    close(fix.weights[0], t(1.5, 1.0, 0.8, 0.0))
    close(fix.metrics["mismatch/tis_clipfrac"], 2 / 3)
    # mask (icepop): weights kept, tokens outside [0.8, 1.5] rejected
    fix = correction(
        old, rollout, mask, AlgoConfig(use_tis=True, tis_mode="mask", tis_lower_bound=0.8, tis_upper_bound=1.5)
    )
    close(fix.weights[0], t(2.0, 1.0, 0.5, 0.0))
    close(fix.keep[0], t(0, 1, 0, 0))
    close(fix.metrics["mismatch/tis_maskfrac"], 2 / 3)
    # lower bound unset: 1 / upper (slime): [0.5, 2] keeps all three
    fix = correction(old, rollout, mask, AlgoConfig(use_tis=True, tis_mode="mask"))
    close(fix.keep[0], t(1, 1, 1, 0))
    assert not fix.weights.requires_grad


def test_is_weights_sequence_and_geometric_levels() -> None:
    # sample 0: r = [ln2, 0, -ln2] (sum 0, mean 0); sample 1: r = [ln2, ln2, pad] (sum 2 ln2, mean ln2)
    old = t(LN2, 0.0, -LN2, LN2, LN2, 0.0).reshape(2, 3)
    mask = t(1, 1, 1, 1, 1, 0).reshape(2, 3)
    rollout = torch.zeros_like(old)
    seq = correction(old, rollout, mask, AlgoConfig(use_tis=True, tis_level="sequence", tis_upper_bound=3.0))
    close(seq.weights, t(1, 1, 1, 3, 3, 0).reshape(2, 3))  # [1, 4 -> truncated to 3]
    geo = correction(old, rollout, mask, AlgoConfig(use_tis=True, tis_level="geometric", tis_upper_bound=3.0))
    close(geo.weights, t(1, 1, 1, 2, 2, 0).reshape(2, 3))
    # batch-normalised to mean 1 over samples: (1 + 2) / 2 = 1.5
    norm = correction(
        old,
        rollout,
        mask,
        AlgoConfig(use_tis=True, tis_level="geometric", tis_upper_bound=3.0, tis_batch_normalize=True),
    )
    close(norm.weights, t(1, 1, 1, 2, 2, 0).reshape(2, 3) / 1.5)
    close(norm.metrics["mismatch/batch_norm_factor"], 1.5)


def test_token_batch_normalisation() -> None:
    old, rollout, mask = t(LN2, 0.0, 0.0)[None], torch.zeros(1, 3, dtype=F64), torch.ones(1, 3, dtype=F64)
    fix = correction(old, rollout, mask, AlgoConfig(use_tis=True, tis_upper_bound=4.0, tis_batch_normalize=True))
    close(fix.weights[0], t(2, 1, 1) / (4 / 3))  # mean of [2, 1, 1] is 4/3


def test_rejection_sampling_and_veto() -> None:
    old, rollout, mask = _ratios()
    rs = correction(old, rollout, mask, AlgoConfig(use_rs=True, rs_lower_bound=0.8, rs_upper_bound=1.5))
    close(rs.keep[0], t(0, 1, 0, 0))
    close(rs.weights[0], t(1, 1, 1, 0))  # no IS: unit weights
    close(rs.metrics["mismatch/rs_maskfrac"], 2 / 3)
    # sequence-level RS rejects the whole sample or none: sum r = 0 -> ratio 1, kept
    rs = correction(
        old, rollout, mask, AlgoConfig(use_rs=True, rs_level="sequence", rs_lower_bound=0.8, rs_upper_bound=1.5)
    )
    close(rs.keep[0], t(1, 1, 1, 0))
    # veto: token ratio 0.5 < 0.6 -> the whole sample is dropped; a second clean sample survives
    old2 = torch.cat([old, torch.zeros_like(old)])
    mask2 = torch.cat([mask, mask])
    veto = correction(old2, torch.zeros_like(old2), mask2, AlgoConfig(rs_veto_threshold=0.6))
    close(veto.keep, t(0, 0, 0, 0, 1, 1, 1, 0).reshape(2, 4))
    close(veto.metrics["mismatch/veto_seqfrac"], 0.5)
    close(veto.metrics["mismatch/rejected_frac"], 0.5)


def test_rejected_tokens_leave_the_numerator_only() -> None:
    batch = _toy_batch()
    new = batch.log_probs.clone().requires_grad_(True)
    denom = Denominators.of(batch)
    base, _ = micro_batch_objective(new, torch.zeros_like(new), batch, AlgoConfig(), denom)
    keep = batch.response_mask.clone()
    keep[0] = 0  # reject sample 0 (advantage +1 on 3 tokens)
    batch.loss_keep = keep
    rejected, _ = micro_batch_objective(new, torch.zeros_like(new), batch, AlgoConfig(), denom)
    # on-policy: per-token loss = -A; 5 tokens: 3 * -1 + 2 * +1 = -1 -> -1/5; rejecting sample 0
    # leaves 2 * +1 over the same 5 tokens
    close(base, -1 / 5, 1e-6)
    close(rejected, 2 / 5, 1e-6)


def test_ess_bounds() -> None:
    assert effective_sample_size(torch.ones(7)) == pytest.approx(1.0)
    assert effective_sample_size(torch.tensor([1.0, 0.0, 0.0, 0.0])) == pytest.approx(0.25)


# ------------------------------------------------------------------------------------------ config


def test_renamed_and_conflicting_options_are_one_clear_line() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"algo\.tis was renamed: use algo\.use_tis"):
        AlgoConfig(tis="icepop")
    with pytest.raises(ValidationError, match=r"algo\.loss_reduction was renamed"):
        AlgoConfig(loss_reduction="sample")
    with pytest.raises(ValidationError, match="use_rollout_logprobs and algo.use_tis"):
        AlgoConfig(use_rollout_logprobs=True, use_tis=True)
    with pytest.raises(ValidationError, match="tis_lower_bound"):
        AlgoConfig(use_tis=True, tis_mode="clip", tis_lower_bound=3.0, tis_upper_bound=2.0)
    assert AlgoConfig().tis_bounds == (0.5, 2.0)  # slime: lower = 1 / upper when unset


# ------------------------------------------------------------------- REINFORCE++ over masked spans


def test_reinforce_plus_plus_discounts_over_masked_tool_tokens() -> None:
    # loss mask [1, 0, 0, 1] (two tool-output tokens in the middle), reward 1 on the last loss token,
    # gamma 0.5, no KL: every response position is a discount step (slime):
    # R3 = 1, R2 = 0.5, R1 = 0.25, R0 = 0.125
    _, ret = compute_advantages("reinforce_plus_plus", t(1.0), [t(1, 0, 0, 1)], 1, gamma=0.5)
    close(ret[0], t(0.125, 0.25, 0.5, 1.0))


class _ZeroLogProbs:
    """A backend stand-in whose log-probs are all 0 (prepare_batch only scores)."""

    def compute_log_probs(self, batch, which="policy"):
        return torch.zeros(batch.response_mask.shape)


def test_prepare_batch_keeps_masked_spans_in_the_returns() -> None:
    sample = Sample(
        group_index=0,
        index=0,
        prompt="p",
        tokens=[1, 2, 5, 6, 7, 8],
        response="r",
        response_length=4,
        loss_mask=[1, 0, 0, 1],
        rollout_log_probs=[-1.0] * 4,
        reward=1.0,
    )
    algo = AlgoConfig(advantage_estimator="reinforce_plus_plus", gamma=0.5)
    batch, _ = prepare_batch(_ZeroLogProbs(), [sample], algo, group_size=1, compute_ref=False)
    # response columns are 1..4 (column j scores token j + 1; the prompt has 2 tokens)
    close(batch.returns[0, 1:5], t(0.125, 0.25, 0.5, 1.0))


def test_whitening_eps_is_1e_8_inside_the_square_root() -> None:
    # returns [1, 3] -> mean 2, unbiased var 2 -> (v - 2) / sqrt(2 + 1e-8)
    adv, _ = compute_advantages("reinforce_plus_plus", t(1.0, 3.0), [t(1.0), t(1.0)], 1)
    close(torch.cat(adv), t(-1.0, 1.0) / math.sqrt(2 + 1e-8))


# -------------------------------------------------------------------------- non-finite steps skipped


def test_minibatch_steps_skips_a_non_finite_loss() -> None:
    batch = _toy_batch()
    calls = {"zero": 0, "step": 0}
    losses = iter([float("nan"), 1.0])

    def micro_step(micro, denom):
        return {"loss": next(losses)}

    def optimizer_step():
        calls["step"] += 1
        return 0.5

    rows: list[dict] = []
    out = minibatch_steps(
        batch,
        2,
        8,
        zero_grad=lambda: calls.__setitem__("zero", calls["zero"] + 1),
        micro_step=micro_step,
        optimizer_step=optimizer_step,
        on_step=rows.append,
    )
    assert calls["step"] == 1  # the NaN step never reached the optimizer
    assert [r["skipped"] for r in rows] == [1.0, 0.0]
    assert out["train/skipped_steps"] == 1.0
    assert out["train/loss"] == 1.0  # the mean is over applied steps


class _ToyLM(torch.nn.Module):
    def __init__(self, vocab: int = 13, dim: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, dim)
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return types.SimpleNamespace(logits=self.out(torch.tanh(self.emb(input_ids))))


def test_torch_backend_never_applies_a_nan_gradient() -> None:
    from rollflow.tasks.train.settings import OptimConfig
    from rollflow.tasks.train.step import train_on_samples
    from rollflow.tasks.train.torch_backend import TorchBackend

    backend = TorchBackend(_ToyLM(), OptimConfig(num_steps_per_rollout=2, micro_batch_size=4, lr=1e-2))
    before = {k: v.clone() for k, v in backend.model.state_dict().items()}
    hook = backend.model.out.weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    result = train_on_samples(backend, _toy_samples(), AlgoConfig(), group_size=2, compute_ref=False)
    hook.remove()
    assert result.metrics["train/skipped_steps"] == 2.0
    assert all(step["skipped"] == 1.0 for step in result.steps)
    for name, value in backend.model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert not backend.optimizer.state  # Adam's moments never saw the NaN either
    # without the hook the same call trains
    result = train_on_samples(backend, _toy_samples(), AlgoConfig(), group_size=2, compute_ref=False)
    assert result.metrics["train/skipped_steps"] == 0.0
    assert not torch.equal(backend.model.out.weight, before["out.weight"])


def test_worker_fails_after_consecutive_skips_and_names_the_rollout(caplog) -> None:
    from rollflow.tasks.train.worker import TrainWorker

    state = types.SimpleNamespace(algo=AlgoConfig(max_consecutive_skipped_steps=3), _consecutive_skips=0)
    TrainWorker._count_skips(state, [{"skipped": 1.0, "loss": float("nan")}, {"skipped": 0.0}], rollout_id=4)
    assert state._consecutive_skips == 0  # a good step resets the count
    TrainWorker._count_skips(state, [{"skipped": 0.0}, {"skipped": 1.0, "loss": float("nan")}], rollout_id=5)
    assert "rollout 5, optimizer step 2/2 skipped" in caplog.text
    with pytest.raises(FloatingPointError, match=r"3 optimizer steps in a row .* rollout 6"):
        TrainWorker._count_skips(state, [{"skipped": 1.0}, {"skipped": 1.0}], rollout_id=6)


def test_k3_mismatch_of_a_tiny_fp32_gap_is_not_negative() -> None:
    # fp32 engines differ by ~1e-7 per token; computed in fp32, e^r - r - 1 rounds to small negative values
    gen = torch.Generator().manual_seed(0)
    rollout = -torch.rand(64, 32, generator=gen)
    old = rollout + torch.randn(64, 32, generator=gen) * 1e-6
    m = mismatch_metrics(old, rollout, torch.ones(64, 32))
    assert 0.0 < m["mismatch/k3_kl"] < 1e-10  # ~ mean(r^2) / 2 = 5e-13
