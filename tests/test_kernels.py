"""Exact-value tests for the numeric kernels in tasks/train (kl, advantages, losses).

Expected values are worked by hand in the comments; float64 throughout so tolerances stay tight.
"""

from __future__ import annotations

import math

import pytest
import torch

from rollflow.tasks.train.advantages import ESTIMATORS, compute_advantages, group_mean_std, whiten
from rollflow.tasks.train.kl import KL_KINDS, approx_kl
from rollflow.tasks.train.losses import (
    entropy_from_logits,
    masked_mean,
    policy_loss,
)

F64 = torch.float64
LN2 = math.log(2.0)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- KL


def test_kl_kinds_exact() -> None:
    # log_ratio = log_probs - ref = [ln2, -ln2, 0]
    lp, ref = t(LN2, 0.0, 0.5), t(0.0, LN2, 0.5)
    close(approx_kl(lp, ref, "k1"), t(LN2, -LN2, 0.0))
    # k2 = 0.5 * lr^2
    close(approx_kl(lp, ref, "k2"), t(0.5 * LN2**2, 0.5 * LN2**2, 0.0))
    # k3 = e^-lr - 1 + lr: lr=ln2 -> 1/2 - 1 + ln2 = ln2 - 0.5; lr=-ln2 -> 2 - 1 - ln2 = 1 - ln2
    k3 = t(LN2 - 0.5, 1.0 - LN2, 0.0)
    close(approx_kl(lp, ref, "k3"), k3)
    # |values| < 10: low_var_kl == k3
    close(approx_kl(lp, ref, "low_var_kl"), k3)
    assert KL_KINDS == ("k1", "k2", "k3", "low_var_kl")


def test_low_var_kl_clamps_and_never_overflows() -> None:
    # lr=-5: e^5 - 1 - 5 = 142.41 -> 10; lr=15: e^-15 - 1 + 15 = 14.0000003 -> 10;
    # lr=-1e4: unclamped k3 would be e^10000 = inf; low_var_kl is still exactly 10 and k3 saturates at
    # k3(-20) = e^20 - 1 - 20; lr=1: e^-1 - 1 + 1 = e^-1.
    lr = t(-5.0, 15.0, -1e4, 1.0)
    out = approx_kl(lr, torch.zeros_like(lr), "low_var_kl")
    close(out, t(10.0, 10.0, 10.0, math.exp(-1.0)))
    close(approx_kl(lr, torch.zeros_like(lr), "k3")[2:3], t(math.exp(20.0) - 21.0))
    lr.requires_grad_(True)
    approx_kl(lr, torch.zeros_like(lr), "low_var_kl").sum().backward()
    # clamped entries have zero gradient; d/dlr (e^-lr - 1 + lr) at 1 = 1 - e^-1
    close(lr.grad, t(0.0, 0.0, 0.0, 1.0 - math.exp(-1.0)))


def test_kl_unknown_kind() -> None:
    with pytest.raises(ValueError, match="k1.*k2.*k3.*low_var_kl"):
        approx_kl(t(0.0), t(0.0), "k4")


# ---------------------------------------------------------------- advantages


def ones(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=F64)


def test_estimator_names() -> None:
    assert ESTIMATORS == ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo")


def test_grpo_without_std_normalization() -> None:
    # group 0: [1, 0, 0, 1], mean 0.5 -> [0.5, -0.5, -0.5, 0.5]; group 1: [3, 1, 2, 2], mean 2
    rewards = t(1, 0, 0, 1, 3, 1, 2, 2)
    masks = [t(1, 1, 0), ones(2), ones(1), ones(4), ones(2), ones(2), ones(2), ones(1)]
    adv, ret = compute_advantages("grpo", rewards, masks, 4, normalize_std=False)
    expected = [0.5, -0.5, -0.5, 0.5, 1.0, -1.0, 0.0, 0.0]
    for a, r, m, e in zip(adv, ret, masks, expected):
        # broadcast to every token, masked-out ones included; returns == advantages
        assert torch.equal(a, torch.full_like(m, e))
        assert torch.equal(r, a)


def test_grpo_std_normalization_is_unbiased() -> None:
    # [1, 0, 0, 1]: centered +-0.5; unbiased var = 4 * 0.25 / 3 = 1/3 -> a = +-0.5 * sqrt(3)
    rewards = t(1, 0, 0, 1)
    masks = [ones(2)] * 4
    adv, _ = compute_advantages("grpo", rewards, masks, 4, eps=0.0)
    h = 0.5 * math.sqrt(3.0)
    close(torch.stack([a[0] for a in adv]), t(h, -h, -h, h))
    # default eps=1e-6 is added to the std: 0.5 / (sqrt(1/3) + 1e-6)
    adv, _ = compute_advantages("grpo", rewards, masks, 4)
    g = 0.5 / (math.sqrt(1.0 / 3.0) + 1e-6)
    close(adv[0], t(g, g))
    # [0, 2]: centered +-1; Bessel std = sqrt(2 / 1) -> +-1/sqrt2 (population std 1 would give +-1)
    adv, _ = compute_advantages("gspo", t(0, 2), [ones(1), ones(1)], 2, eps=0.0)
    close(torch.cat(adv), t(-1 / math.sqrt(2.0), 1 / math.sqrt(2.0)))
    mean, std = group_mean_std(t(0, 2, 5, 5), 2)
    close(mean, t(1.0, 5.0))
    close(std, t(math.sqrt(2.0), 0.0))


def test_grpo_constant_group_gives_exact_zeros() -> None:
    # mean([0.1, 0.1, 0.1]) = 0.30000000000000004 / 3 misses 0.1 by ~1.4e-17 and the std is an
    # ulp too, so a naive (r - mean) / std would be -0.8165 with eps=0; the output is exactly 0
    g = t(0.1, 0.1, 0.1)
    assert not torch.equal(g - g.mean(), torch.zeros(3, dtype=F64))
    for eps in (1e-6, 0.0):
        adv, _ = compute_advantages("grpo", t(0.1, 0.1, 0.1, 1, 0, 2), [ones(3)] * 6, 3, eps=eps)
        for a in adv[:3]:
            assert torch.equal(a, torch.zeros(3, dtype=F64))
        assert all(torch.isfinite(a).all() for a in adv)
    # a group of one is constant too
    adv, _ = compute_advantages("grpo", t(7.0), [ones(2)], 1)
    assert torch.equal(adv[0], torch.zeros(2, dtype=F64))


def test_rloo() -> None:
    # group [3, 1, 2]: 3 - (1+2)/2 = 1.5; 1 - (3+2)/2 = -1.5; 2 - (3+1)/2 = 0  (= 3/2 * (r - 2))
    # group [1, 0, 0]: 1 - 0 = 1; 0 - 1/2 = -0.5 (x2)
    adv, ret = compute_advantages("rloo", t(3, 1, 2, 1, 0, 0), [ones(2)] * 6, 3)
    close(torch.stack([a[0] for a in adv]), t(1.5, -1.5, 0.0, 1.0, -0.5, -0.5))
    assert all(torch.equal(a, r) for a, r in zip(adv, ret))
    with pytest.raises(ValueError, match="group_size"):
        compute_advantages("rloo", t(1.0, 2.0), [ones(1)] * 2, 1)


def test_reinforce_plus_plus_gamma_and_kl() -> None:
    # kl_coef = 0.5, gamma = 0.5
    # s0: mask [1,1,1], kl [1,2,0] -> token rewards [-0.5,-1,0], +2 at t=2 -> [-0.5,-1,2]
    #     R2 = 2; R1 = -1 + 0.5*2 = 0; R0 = -0.5 + 0.5*0 = -0.5      -> [-0.5, 0, 2]
    # s1: mask [1,1,0], kl [2,0,4] -> masked-out t=2 has no penalty -> [-1,0,0], +1 at t=1
    #     -> [-1,1,0]; R2 = 0; R1 = 1; R0 = -1 + 0.5*1 = -0.5          -> [-0.5, 1, 0]
    rewards = t(2, 1)
    masks = [t(1, 1, 1), t(1, 1, 0)]
    kl = [t(1, 2, 0), t(2, 0, 4)]
    adv, ret = compute_advantages(
        "reinforce_plus_plus", rewards, masks, 2, kl=kl, kl_coef=0.5, gamma=0.5, eps=0.0, whiten_eps=0.0
    )
    close(ret[0], t(-0.5, 0.0, 2.0))
    close(ret[1], t(-0.5, 1.0, 0.0))
    # whiten over the 5 masked returns [-0.5, 0, 2, -0.5, 1]: mean 0.4;
    # deviations [-0.9,-0.4,1.6,-0.9,0.6], squares sum 0.81+0.16+2.56+0.81+0.36 = 4.7, var 4.7/4
    s = math.sqrt(4.7 / 4)
    close(adv[0], t(-0.9 / s, -0.4 / s, 1.6 / s))
    # the masked-out token gets the same transform: (0 - 0.4) / s
    close(adv[1], t(-0.9 / s, 0.6 / s, -0.4 / s))
    # kl=None means no penalty: returns with gamma=1 are the reward on every token up to the end
    _, ret = compute_advantages("reinforce_plus_plus", rewards, masks, 2)
    close(ret[0], t(2, 2, 2))
    close(ret[1], t(1, 1, 0))


def test_reinforce_plus_plus_baseline() -> None:
    # rewards [1, 0] (one group), mean 0.5 -> [0.5, -0.5]; kl_coef 0.5
    # s0: mask [1,1], kl [0,1]   -> [0.5 - 0, 0.5 - 0.5]        = [0.5, 0]
    # s1: mask [1,1,0], kl [1,0,2] -> [-0.5-0.5, -0.5-0, -0.5-0] = [-1, -0.5, -0.5]
    # masked [0.5, 0, -1, -0.5]: mean -0.25; deviations [0.75, 0.25, -0.75, -0.25];
    # squares 0.5625+0.0625+0.5625+0.0625 = 1.25; unbiased var 1.25/3 = 5/12
    adv, ret = compute_advantages(
        "reinforce_plus_plus_baseline",
        t(1, 0),
        [t(1, 1), t(1, 1, 0)],
        2,
        kl=[t(0, 1), t(1, 0, 2)],
        kl_coef=0.5,
        eps=0.0,
        whiten_eps=0.0,
    )
    s = math.sqrt(5 / 12)
    close(adv[0], t(0.75 / s, 0.25 / s))
    close(adv[1], t(-0.75 / s, -0.25 / s, -0.25 / s))
    assert all(torch.equal(a, r) for a, r in zip(adv, ret))


def test_whiten_default_eps_and_small_masks() -> None:
    # [1, 3] masked: mean 2, unbiased var 2 -> (v - 2) / sqrt(2 + 1e-8)
    out = whiten([t(1, 3, 5)], [t(1, 1, 0)])
    close(out[0], t(-1, 1, 3) / math.sqrt(2 + 1e-8))
    # one masked token, or no spread among masked tokens: centered only, never scaled by
    # 1/sqrt(eps) (= 1e4), which would turn the masked-out 10 into 6e4
    out = whiten([t(4, 10)], [t(1, 0)])
    close(out[0], t(0, 6))
    out = whiten([t(4, 4, 10)], [t(1, 1, 0)])
    close(out[0], t(0, 0, 6))


def test_advantage_argument_errors() -> None:
    with pytest.raises(ValueError, match="group_size"):
        compute_advantages("grpo", t(1, 2, 3), [ones(1)] * 3, 2)
    with pytest.raises(ValueError, match="estimator"):
        compute_advantages("ppo2", t(1, 2), [ones(1)] * 2, 2)
    with pytest.raises(ValueError, match="kl_coef"):
        compute_advantages("grpo", t(1, 2), [ones(1)] * 2, 2, kl=[ones(1)] * 2, kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_coef"):
        compute_advantages("reinforce_plus_plus", t(1, 2), [ones(1)] * 2, 2, kl_coef=0.1)
    with pytest.raises(ValueError, match="gamma"):
        compute_advantages("grpo", t(1, 2), [ones(1)] * 2, 2, gamma=0.9)
    with pytest.raises(ValueError, match="response_masks"):
        compute_advantages("grpo", t(1, 2), [ones(1)], 2)


# ---------------------------------------------------------------- policy loss


def terms(ratio: torch.Tensor, adv: torch.Tensor, **kw: float):
    return policy_loss(torch.log(ratio), torch.zeros_like(ratio), adv, **kw)


def test_policy_loss_unclipped() -> None:
    # eps 0.2: ratios 1.1 and 0.9 inside [0.8, 1.2] -> loss = -A * ratio = [-1.1, -2 * -0.9 = 1.8]
    out = terms(t(1.1, 0.9), t(1.0, -2.0), eps_clip=0.2)
    close(out.loss, t(-1.1, 1.8))
    assert torch.equal(out.clipped, t(0, 0))
    assert torch.equal(out.dual_clipped, t(0, 0))
    close(out.ppo_kl, -torch.log(t(1.1, 0.9)))


def test_policy_loss_asymmetric_clip() -> None:
    # eps_clip 0.2, eps_clip_high 0.28 -> ratio clamped to [0.8, 1.28]
    # A=+1, r=1.5 : pg1 -1.5, pg2 -1.28 -> -1.28 (clipped)
    # A=+1, r=1.25: inside the high bound -> -1.25 (symmetric 0.2 would clip it to -1.2)
    # A=-1, r=0.5 : pg1 0.5,  pg2 0.8   -> 0.8   (clipped)
    # A=-1, r=1.5 : pg1 1.5,  pg2 1.28  -> 1.5   (not clipped: unbounded above)
    # A=+1, r=0.5 : pg1 -0.5, pg2 -0.8  -> -0.5  (not clipped)
    ratio, adv = t(1.5, 1.25, 0.5, 1.5, 0.5), t(1, 1, -1, -1, 1)
    out = terms(ratio, adv, eps_clip=0.2, eps_clip_high=0.28)
    close(out.loss, t(-1.28, -1.25, 0.8, 1.5, -0.5))
    assert torch.equal(out.clipped, t(1, 0, 1, 0, 0))
    sym = terms(ratio, adv, eps_clip=0.2)
    close(sym.loss, t(-1.2, -1.2, 0.8, 1.5, -0.5))
    assert torch.equal(sym.clipped, t(1, 1, 1, 0, 0))


def test_policy_loss_dual_clip_changes_result() -> None:
    # eps_clip 0.2, eps_clip_c 3
    # A=-1, r=5: pg1 5, pg2 1.2 -> 5; pg3 = 3 < 5 -> 3 (dual clipped)
    # A=-1, r=2: pg1 2 -> 2; pg3 3 > 2 -> 2
    # A=+1, r=5: pg1 -5, pg2 -1.2 -> -1.2; A > 0 so pg3 = -3 is not applied
    # A=-2, r=4: pg1 8, pg2 2.4 -> 8; pg3 = 6 -> 6 (dual clipped)
    ratio, adv = t(5, 2, 5, 4), t(-1, -1, 1, -2)
    plain = terms(ratio, adv, eps_clip=0.2)
    close(plain.loss, t(5, 2, -1.2, 8))
    log_probs = torch.log(ratio).requires_grad_(True)
    dual = policy_loss(log_probs, torch.zeros_like(ratio), adv, eps_clip=0.2, eps_clip_c=3.0)
    close(dual.loss, t(3, 2, -1.2, 6))
    assert torch.equal(dual.dual_clipped, t(1, 0, 0, 1))
    assert torch.equal(dual.clipped, plain.clipped)  # t(0, 0, 1, 0)
    # the bound is constant in log_probs: no gradient through dual-clipped tokens
    # d/dlp (-A * e^lp) = -A * r: token 1 -> 2; clipped token 2 -> 0
    dual.loss.sum().backward()
    close(log_probs.grad, t(0, 2, 0, 0))
    for bad in (1.0, 0.5):
        with pytest.raises(ValueError, match="eps_clip_c"):
            terms(ratio, adv, eps_clip=0.2, eps_clip_c=bad)


def test_policy_loss_on_policy_is_exact() -> None:
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 7, generator=g, dtype=F64) * 5
    adv = torch.randn(4, 7, generator=g, dtype=F64)
    out = policy_loss(lp, lp.clone(), adv, eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0)
    assert torch.equal(out.ratio, torch.ones_like(lp))
    assert torch.equal(out.ppo_kl, torch.zeros_like(lp))
    assert torch.equal(out.clipped, torch.zeros_like(lp))
    assert torch.equal(out.dual_clipped, torch.zeros_like(lp))
    assert torch.equal(out.loss, -adv)


# ---------------------------------------------------------------- reductions, entropy, IS


def test_masked_mean_reductions() -> None:
    v = t(1, 2, 3, 4, 5, 6, 7, 8, 9).reshape(3, 3)
    m = t(1, 1, 0, 1, 0, 0, 0, 0, 0).reshape(3, 3)
    # per token: (1 + 2 + 4) / 3
    close(masked_mean(v, m), torch.tensor(7 / 3, dtype=F64))
    # per sample: rows (1+2)/2 = 1.5 and 4/1 = 4, empty row 3 ignored -> (1.5 + 4) / 2 = 2.75
    close(masked_mean(v, m, per_sample=True), torch.tensor(2.75, dtype=F64))
    # packed: same tokens flattened, grouped by sample id
    ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    close(masked_mean(v.flatten(), m.flatten(), per_sample=True, sample_ids=ids), torch.tensor(2.75, dtype=F64))
    # empty mask -> 0 (both reductions), NaN/inf in masked-out slots never leak
    zero = torch.zeros(3, 3, dtype=F64)
    assert torch.equal(masked_mean(v, zero), torch.tensor(0.0, dtype=F64))
    assert torch.equal(masked_mean(v, zero, per_sample=True), torch.tensor(0.0, dtype=F64))
    v_bad = v.clone()
    v_bad[2] = float("nan")
    v_bad[1, 1] = float("-inf")
    close(masked_mean(v_bad, m), torch.tensor(7 / 3, dtype=F64))
    with pytest.raises(ValueError, match="sample_ids"):
        masked_mean(v, m, sample_ids=torch.zeros(3, 3))


def test_entropy_uniform_and_one_hot() -> None:
    # uniform over 4: H = -4 * (1/4) * ln(1/4) = ln 4 (any constant shift of the logits)
    close(entropy_from_logits(torch.full((2, 4), 123.0, dtype=F64)), t(math.log(4.0), math.log(4.0)))
    # one-hot: 1 * ln 1 + 0 * ln 0 = 0, with -inf logits and with huge finite gaps
    logits = t(0.0, float("-inf"), float("-inf"), 5000.0, 0.0, -5000.0).reshape(2, 3).requires_grad_(True)
    h = entropy_from_logits(logits)
    assert torch.equal(h, t(0.0, 0.0))
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()
