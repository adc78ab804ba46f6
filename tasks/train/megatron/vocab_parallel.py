"""Token log-probs and entropy from vocabulary-parallel logits: no rank ever holds the full vocabulary.

Each tensor-parallel rank holds the logits of its vocabulary slice [start, start + V/tp). The softmax
statistics are reduced over the TP group: the row max (MAX), then the sum of exp and the target logit
(one SUM of both), then E_p[z] (SUM) for the entropy. The backward needs no communication: with the
global log-sum-exp and E_p[z] saved, each rank writes the gradient of its own slice, and Megatron's
column-parallel output layer reduces the input gradient over the group itself.

Plain torch.distributed (no Megatron import): `group=None` is the one-rank case with no collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _scaled(logits: torch.Tensor, start: int, vocab_size: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits / T, and the mask of this slice's columns that are real tokens (not vocab padding)."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    z = logits.to(dtype) / temperature
    cols = torch.arange(start, start + logits.shape[-1], device=logits.device)
    return z, cols < vocab_size


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, start: int, vocab_size: int, temperature: float, group):
        z, real = _scaled(logits, start, vocab_size, temperature)
        z = torch.where(real, z, torch.full_like(z, float("-inf")))
        row_max = _all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX, group)
        local = target - start
        mine = (local >= 0) & (local < logits.shape[-1])
        zt = torch.where(
            mine,
            z.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1),
            torch.zeros_like(row_max),
        )
        sums = _all_reduce(torch.stack([(z - row_max.unsqueeze(-1)).exp().sum(dim=-1), zt]), dist.ReduceOp.SUM, group)
        lse = row_max + sums[0].log()
        p = (z - lse.unsqueeze(-1)).exp()  # 0 on padding columns
        ez = _all_reduce(torch.where(real, p * z, torch.zeros_like(z)).sum(dim=-1), dist.ReduceOp.SUM, group)
        ctx.save_for_backward(logits, target, lse, ez)
        ctx.cfg = (start, vocab_size, temperature)
        return sums[1] - lse, lse - ez

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        logits, target, lse, ez = ctx.saved_tensors
        start, vocab_size, temperature = ctx.cfg
        z, real = _scaled(logits, start, vocab_size, temperature)
        p = torch.where(real, (z - lse.unsqueeze(-1)).exp(), torch.zeros_like(z))
        g_lp = torch.zeros_like(lse) if grad_lp is None else grad_lp
        coeff = g_lp.unsqueeze(-1) * p
        if grad_ent is not None:  # dH/dz = -p (z - E_p[z])
            coeff = coeff + grad_ent.unsqueeze(-1) * p * torch.where(real, z - ez.unsqueeze(-1), torch.zeros_like(z))
        cols = torch.arange(start, start + logits.shape[-1], device=logits.device)
        onehot = (cols == target.unsqueeze(-1)).to(z.dtype)
        grad = (onehot * g_lp.unsqueeze(-1) - coeff) / temperature
        return grad.to(logits.dtype), None, None, None, None, None


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    temperature: float = 1.0,
    group=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and the entropy of softmax(logits / T) over the real vocabulary, fp32, shaped as `target`.

    `logits` [..., V_slice] is this rank's slice starting at global column `vocab_start`; columns at or
    beyond `vocab_size` are Megatron's vocabulary padding and carry no probability. `target` holds global
    token ids. Every rank of `group` must call this with the same rows.
    """
    shape = target.shape
    lp, ent = _VocabParallelLogProbs.apply(
        logits.reshape(-1, logits.shape[-1]),
        target.reshape(-1),
        int(vocab_start),
        int(vocab_size),
        float(temperature),
        group,
    )
    return lp.reshape(shape), ent.reshape(shape)
