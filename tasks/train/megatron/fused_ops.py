"""Memory-lean kernels of the megatron backend: token log-probs + entropy from logits, and RoPE.

Each is a `torch.autograd.Function` whose forward is the same function with and without grad (old and
reference log-probs are computed under no_grad, the training forward with grad; step-1 exactness needs
the two to be bit-identical). Two implementations of the log-prob kernel:

- "chunked": eager torch over row chunks; fp32 temporaries live for one chunk only.
- "compiled": the same math as two `torch.compile`d functions (forward: reductions over the vocab row;
  backward: one pointwise pass writing the logits' gradient), no fp32 copy of the logits at all.

`rope_sbhd` is a compiled RoPE for Megatron's `apply_rope_fusion` hook (megatron-core calls
`rope_utils.fused_apply_rotary_pos_emb(t, freqs, interleaved=...)`, normally Transformer Engine's).
"""

from __future__ import annotations

import functools

import torch

# ------------------------------------------------------------------------------------------ log-probs


def _lp_forward(logits: torch.Tensor, target: torch.Tensor, inv_t: float, vocab: int, dtype: torch.dtype):
    z = logits[:, :vocab].to(dtype) * inv_t
    lse = torch.logsumexp(z, dim=-1)
    zt = torch.gather(z, -1, target.unsqueeze(-1)).squeeze(-1)
    p = torch.exp(z - lse.unsqueeze(-1))
    ez = (p * z).sum(dim=-1)
    return zt - lse, lse - ez, lse, ez


def _lp_backward(
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    ez: torch.Tensor,
    g_lp: torch.Tensor,
    g_ent: torch.Tensor,
    inv_t: float,
    vocab: int,
    with_entropy: bool,
):
    z = logits[:, :vocab].to(lse.dtype) * inv_t
    p = torch.exp(z - lse.unsqueeze(-1))
    coeff = g_lp.unsqueeze(-1)
    if with_entropy:  # d lp/dz = onehot - p ; d H/dz = -p (z - E_p[z])
        coeff = coeff + g_ent.unsqueeze(-1) * (z - ez.unsqueeze(-1))
    cols = torch.arange(vocab, device=logits.device).unsqueeze(0)
    onehot = (cols == target.unsqueeze(-1)).to(lse.dtype)
    return ((onehot * g_lp.unsqueeze(-1) - p * coeff) * inv_t).to(logits.dtype)


@functools.lru_cache(maxsize=None)
def _compiled(name: str):
    fn = {"forward": _lp_forward, "backward": _lp_backward}[name]
    return torch.compile(fn, dynamic=True)


class _TokenLogProbs(torch.autograd.Function):
    """log p(target) and entropy of softmax(logits[:, :vocab] / T), in fp32 (fp64 for fp64 logits)."""

    @staticmethod
    def forward(ctx, logits, target, temperature: float, vocab: int, chunk: int, impl: str, want_entropy_grad: bool):
        n = logits.shape[0]
        dtype = torch.promote_types(logits.dtype, torch.float32)
        inv_t = 1.0 / temperature
        if impl == "compiled":
            log_probs, entropy, lse, ez = _compiled("forward")(logits, target, inv_t, vocab, dtype)
        elif impl == "chunked":
            log_probs, entropy, lse, ez = (torch.empty(n, dtype=dtype, device=logits.device) for _ in range(4))
            for start in range(0, n, chunk):
                rows = slice(start, min(start + chunk, n))
                z = logits[rows, :vocab].to(dtype, copy=True)  # a copy: modified in place below
                if temperature != 1.0:
                    z.div_(temperature)
                row_lse = torch.logsumexp(z, dim=-1)
                log_probs[rows] = z.gather(-1, target[rows].unsqueeze(-1)).squeeze(-1) - row_lse
                p = (z - row_lse.unsqueeze(-1)).exp_()
                row_ez = torch.linalg.vecdot(p, z)  # E_p[z]
                entropy[rows] = row_lse - row_ez
                lse[rows] = row_lse
                ez[rows] = row_ez
        else:
            raise ValueError(f"log-prob impl {impl!r}: expected 'chunked' or 'compiled'")
        ctx.save_for_backward(logits, target, lse, ez)
        ctx.cfg = (temperature, vocab, chunk, impl, want_entropy_grad)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        logits, target, lse, ez = ctx.saved_tensors
        temperature, vocab, chunk, impl, want_entropy_grad = ctx.cfg
        n = logits.shape[0]
        with_entropy = want_entropy_grad and grad_ent is not None
        if grad_lp is None:
            grad_lp = torch.zeros(n, dtype=lse.dtype, device=logits.device)
        if grad_ent is None:
            grad_ent = torch.zeros(n, dtype=lse.dtype, device=logits.device)
        grad = torch.zeros_like(logits) if vocab < logits.shape[1] else torch.empty_like(logits)
        if impl == "compiled":
            grad[:, :vocab] = _compiled("backward")(
                logits,
                target,
                lse,
                ez,
                grad_lp.contiguous(),
                grad_ent.contiguous(),
                1.0 / temperature,
                vocab,
                with_entropy,
            )
            return grad, None, None, None, None, None, None
        for start in range(0, n, chunk):
            rows = slice(start, min(start + chunk, n))
            z = logits[rows, :vocab].to(lse.dtype, copy=True)
            if temperature != 1.0:
                z.div_(temperature)
            p = (z - lse[rows].unsqueeze(-1)).exp_()
            g_lp = grad_lp[rows].unsqueeze(-1)
            if with_entropy:
                coeff = z.sub_(ez[rows].unsqueeze(-1)).mul_(grad_ent[rows].unsqueeze(-1)).add_(g_lp)
                g = p.mul_(coeff).neg_()
            else:
                g = p.mul_(g_lp).neg_()
            g.scatter_add_(-1, target[rows].unsqueeze(-1), g_lp)
            if temperature != 1.0:
                g.div_(temperature)
            grad[rows, :vocab] = g.to(grad.dtype)
        return grad, None, None, None, None, None, None


def token_log_probs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk: int = 2048,
    impl: str = "chunked",
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V_pad], target [...] -> (log_probs, entropy) of softmax(logits[..., :vocab_size] / T).

    Columns past `vocab_size` (Megatron's vocab padding) are ignored and get zero gradient. The entropy's
    gradient flows only with `entropy_grad=True` (an entropy bonus in the loss); otherwise it is a metric.
    """
    shape = target.shape
    flat = logits.reshape(-1, logits.shape[-1])  # a view for a contiguous prefix (seq-first logits[:-1])
    vocab = int(vocab_size or logits.shape[-1])
    lp, ent = _TokenLogProbs.apply(
        flat, target.reshape(-1), float(temperature), vocab, int(chunk), impl, bool(entropy_grad)
    )
    if not entropy_grad:
        ent = ent.detach()
    return lp.view(shape), ent.view(shape)


# ------------------------------------------------------------------------------------------------ RoPE


def _rope_forward(t: torch.Tensor, freqs: torch.Tensor, sign: float) -> torch.Tensor:
    """t [s, b, h, d], freqs [s, 1, 1, rot]; rotate-half RoPE on the first `rot` dims (sign -1: inverse)."""
    rot = freqs.shape[-1]
    x = t[..., :rot].float()
    cos, sin = torch.cos(freqs), torch.sin(freqs) * sign
    x1, x2 = x.chunk(2, dim=-1)
    out = (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(t.dtype)
    return torch.cat((out, t[..., rot:]), dim=-1) if rot < t.shape[-1] else out


@functools.lru_cache(maxsize=None)
def _compiled_rope():
    return torch.compile(_rope_forward, dynamic=True)


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs):
        ctx.save_for_backward(freqs)
        # detached: the compiled function guards on requires_grad, and scoring (no grad) next to training (grad)
        # recompiled it until dynamo's recompile limit sent RoPE back to eager (seen on the H200)
        return _compiled_rope()(t.detach(), freqs.detach(), 1.0)

    @staticmethod
    def backward(ctx, grad):
        (freqs,) = ctx.saved_tensors
        # RoPE is a rotation: its transpose is the rotation by -angle.
        return _compiled_rope()(grad.contiguous().detach(), freqs.detach(), -1.0), None


def rope_sbhd(
    t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False, interleaved: bool = False
) -> torch.Tensor:
    """Megatron's `fused_apply_rotary_pos_emb` signature (sbhd layout, rotate-half, no interleave)."""
    if interleaved:
        raise NotImplementedError("rope_sbhd: interleaved RoPE is not implemented")
    return _RoPE.apply(t, freqs)


def rope_thd(
    t: torch.Tensor,
    cu_seqlens: torch.Tensor,
    freqs: torch.Tensor,
    cp_size: int = 1,
    cp_rank: int = 0,
    interleaved: bool = False,
) -> torch.Tensor:
    """Megatron's `fused_apply_rotary_pos_emb_thd` signature: RoPE of packed rows [t, h, d], each row from position 0.

    Each token's position is found on the device (its row from `cu_seqlens` by searchsorted), so nothing is
    read back to the host; megatron-core's own thd RoPE splits the rows with `.tolist()` / `.item()` in every
    layer, two device syncs per call. Then the same compiled rotation as `rope_sbhd`.

    Context parallel (cp_size > 1): `cu_seqlens` are the whole rows' bounds and `t` holds this rank's 1 / cp of
    each row, its chunks cp_rank and 2cp-1-cp_rank (context_parallel.py), as megatron-core's thd RoPE assumes.
    """
    if interleaved:
        raise NotImplementedError("rope_thd: interleaved RoPE is not implemented")
    return _RoPE.apply(t.unsqueeze(1), freqs[_thd_positions(cu_seqlens, t.shape[0], cp_size, cp_rank)]).squeeze(1)


def _thd_positions(cu_seqlens: torch.Tensor, n: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Each packed token's position in its row, computed once per micro-batch: every layer's q and k come with the
    same `cu_seqlens` tensor (2 x layers calls), so the result is kept on that tensor object and dies with it."""
    key = (n, cp_size, cp_rank)
    cached = getattr(cu_seqlens, "_rollflow_rope_positions", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    local = torch.div(cu_seqlens, cp_size, rounding_mode="floor")
    index = torch.arange(n, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    row = torch.searchsorted(local[1:], index, right=True)
    positions = (index - local[row]).long()
    if cp_size > 1:
        chunk = torch.div(cu_seqlens[row + 1] - cu_seqlens[row], 2 * cp_size, rounding_mode="floor").long()
        first = positions < chunk
        positions = torch.where(
            first, cp_rank * chunk + positions, (2 * cp_size - 1 - cp_rank) * chunk + positions - chunk
        )
    cu_seqlens._rollflow_rope_positions = (key, positions)
    return positions


def install_rope_fusion() -> None:
    """Point megatron-core's fused-RoPE hooks (sbhd and packed thd) at `rope_sbhd` / `rope_thd` (they are
    Transformer Engine's when TE is present)."""
    from megatron.core.models.common.embeddings import rope_utils  # optional dependency: imported on use

    if rope_utils.fused_apply_rotary_pos_emb is None or rope_utils.fused_apply_rotary_pos_emb is rope_sbhd:
        rope_utils.fused_apply_rotary_pos_emb = rope_sbhd
    if getattr(rope_utils, "fused_apply_rotary_pos_emb_thd", None) in (None, rope_thd):
        rope_utils.fused_apply_rotary_pos_emb_thd = rope_thd
