"""Context parallelism without Transformer Engine: the sequence split over the cp ranks, Megatron's way.

Layout (Megatron's, which its RoPE and TE's attention assume): a sequence of length S (a multiple of
2 x cp) is cut into 2 x cp chunks of m = S / (2 cp) tokens; cp rank r holds chunks r and 2cp - 1 - r,
in that order, so every rank gets the same share of the causal attention's work. Packed (THD) micro-
batches split every row that way (each row's segment a multiple of 2 x cp), the rows end to end.

Attention: each rank gathers every rank's keys / values (`gather_context`, whose backward sums the
gradients of all ranks' attention and hands each rank its own part) and lets each of its two query
chunks attend causally to the keys up to its own end (`chunk_attention`). That is the all-gather form
of context-parallel attention: simple and exact; TE's ring of send / receive overlaps the exchange with
compute instead and is what a large run should use (layer_spec=te).

Loss: the model's outputs are this rank's positions only. Each rank scores its positions against the
next token of the WHOLE sequence (every rank holds the micro-batch), then `gather_context(...,
backward="slice")` puts the log-probs of all ranks back in sequence order: every cp rank computes the
same full objective, and each rank's backward keeps only the gradient of its own positions, so the sum
over cp ranks is the single-rank gradient (Megatron's schedule multiplies the loss by cp and its DDP
averages over dp x cp: the two cancel, schedule.schedule_loss_scale needs no cp term).
"""

from __future__ import annotations

import functools

import torch


def _check(length: int, cp: int) -> int:
    if length % (2 * cp):
        raise ValueError(f"a context-parallel sequence of {length} tokens is not a multiple of 2 x cp = {2 * cp}")
    return length // (2 * cp)


def zigzag_positions(length: int, cp: int, rank: int) -> torch.Tensor:
    """Indices (into a sequence of `length`) of the tokens cp rank `rank` holds, in its local order."""
    m = _check(length, cp)
    return torch.cat(
        [torch.arange(rank * m, (rank + 1) * m), torch.arange((2 * cp - 1 - rank) * m, (2 * cp - rank) * m)]
    )


def packed_zigzag_positions(bounds: tuple[int, ...], cp: int, rank: int) -> torch.Tensor:
    """The same for packed rows: `bounds` are the segments' cumulative starts in the whole packed sequence
    (each segment a multiple of 2 x cp); the rank's tokens are its two chunks of every segment in turn."""
    parts = [a + zigzag_positions(b - a, cp, rank) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def local_bounds(bounds: tuple[int, ...], cp: int) -> tuple[int, ...]:
    """A rank's own cumulative segment starts (every segment holds 1 / cp of its tokens on each rank)."""
    return tuple(b // cp for b in bounds)


def gather_order(positions_by_rank: list[torch.Tensor]) -> torch.Tensor:
    """For every position of the whole sequence, its index in the ranks' local tensors laid end to end
    (what `gather_context` returns before reordering)."""
    flat = torch.cat(positions_by_rank)
    order = torch.empty_like(flat)
    order[flat] = torch.arange(flat.numel())
    return order


@functools.cache
def padded_layout(length: int, cp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's positions, the gather order) for right-padded rows of `length` (cached: same per shape)."""
    positions = [zigzag_positions(length, cp, r) for r in range(cp)]
    return positions[rank], gather_order(positions)


class _GatherContext(torch.autograd.Function):
    """All-gather along dim 0 over the cp group. Backward `sum`: every rank's gradient of the gathered tensor
    is summed and each rank keeps its part (keys / values feed every rank's attention). Backward `slice`: each
    rank keeps its own part of its own gradient (the gathered values feed the same loss on every rank)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group, backward: str) -> torch.Tensor:
        ctx.group, ctx.backward = group, backward
        size = torch.distributed.get_world_size(group)
        out = local.new_empty((size * local.shape[0],) + tuple(local.shape[1:]))
        torch.distributed.all_gather_into_tensor(out, local.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rank = torch.distributed.get_rank(ctx.group)
        size = torch.distributed.get_world_size(ctx.group)
        grad = grad.contiguous()
        n = grad.shape[0] // size
        if ctx.backward == "sum":
            mine = grad.new_empty((n,) + tuple(grad.shape[1:]))
            torch.distributed.reduce_scatter_tensor(mine, grad, group=ctx.group)
            return mine, None, None
        return grad[rank * n : (rank + 1) * n].clone(), None, None


def gather_context(local: torch.Tensor, order: torch.Tensor, group, *, backward: str = "sum") -> torch.Tensor:
    """Every cp rank's `local` ([n, ...], dim 0 the sequence) in whole-sequence order ([cp * n, ...])."""
    if backward not in ("sum", "slice"):
        raise ValueError(f"backward={backward!r}: expected 'sum' or 'slice'")
    gathered = _GatherContext.apply(local, group, backward)
    return gathered.index_select(0, order.to(gathered.device))


def chunk_attention(attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp: int, rank: int) -> torch.Tensor:
    """Causal attention of one rank's two query chunks of a sequence against the whole sequence's keys.

    q: [..., 2m, hn] (chunks rank and 2cp-1-rank), k / v: [..., 2 cp m, hn] in sequence order; `attend(q, k,
    v, mask)` is scaled-dot-product attention with an optional mask. Chunk c sees keys [0, (c + 1) m), the
    last m of them causally (the lower-right causal mask: the queries are the last rows of that block)."""
    from torch.nn.attention.bias import causal_lower_right

    m = q.shape[-2] // 2
    outs = []
    for half, chunk in enumerate((rank, 2 * cp - 1 - rank)):
        end = (chunk + 1) * m
        outs.append(
            attend(q[..., half * m : (half + 1) * m, :], k[..., :end, :], v[..., :end, :], causal_lower_right(m, end))
        )
    return torch.cat(outs, dim=-2)
