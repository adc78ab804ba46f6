"""vocab_parallel_log_probs on one rank against plain log_softmax autograd (no Megatron needed)."""

from __future__ import annotations

import torch

from rollflow.tasks.train.megatron.vocab_parallel import vocab_parallel_log_probs


def test_one_rank_equals_log_softmax_values_and_grads():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 9, 64, generator=g, dtype=torch.float64) * 4).requires_grad_(True)
    target = torch.randint(0, 50, (4, 9), generator=g)
    w_lp, w_ent = (
        torch.randn(4, 9, generator=g, dtype=torch.float64),
        torch.randn(4, 9, generator=g, dtype=torch.float64),
    )
    lp, ent = vocab_parallel_log_probs(logits, target, vocab_start=0, vocab_size=50, temperature=0.8)
    (lp * w_lp + ent * w_ent).sum().backward()

    ref_logits = logits.detach().clone().requires_grad_(True)
    logp = torch.log_softmax(ref_logits[..., :50] / 0.8, dim=-1)  # columns >= 50 are vocabulary padding
    ref_lp = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    (ref_lp * w_lp + ref_ent * w_ent).sum().backward()
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-12)
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=0, atol=1e-12)
    assert torch.all(logits.grad[..., 50:] == 0)
