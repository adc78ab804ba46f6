"""`TrainBatch`: the tensors one train call works on, built from `Sample`s.

Layout: sequences right-padded to one width L; per-token tensors are "target aligned", shape
[B, L-1], where column j scores tokens[:, j + 1]. Every log-prob (old, ref, new) comes from the same
teacher-forced forward on this layout, which is what makes log_probs == ref_log_probs exact at step 1.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from rollflow.artifacts.sample import Sample, Status
from rollflow.tasks.model.routing import batch_routes
from rollflow.tasks.model.teacher_forced import right_padded


@dataclasses.dataclass
class TrainBatch:
    # [B, L] int32 (or int64), right-padded. Token ids are vocabulary indices, far below 2**31, as in the
    # artifact's columns; consumers widen a micro-batch to long where an op needs it (embedding, gather).
    tokens: torch.Tensor
    # [B] long: real tokens per row. The [B, L] attention mask and position ids follow from it (rows are
    # right-padded), so they are computed when asked for, per micro-batch, instead of held for the whole
    # rollout: two int64 [B, L] tensors were 16 of the batch's 33 bytes per token.
    lengths: torch.Tensor
    # [B, L-1] bool: response tokens that count in the loss (a nonzero loss_mask entry). Bool, not float:
    # 1 byte per token instead of 4; every consumer converts (`mask.to(dtype)`) or compares (`mask > 0`).
    response_mask: torch.Tensor
    rewards: torch.Tensor  # [B] float64, the scalar training reward
    rollout_log_probs: torch.Tensor  # [B, L-1] float32, 0 outside response_mask
    group_size: int
    truncated: torch.Tensor  # [B] bool
    log_probs: torch.Tensor | None = None  # old policy, [B, L-1]
    ref_log_probs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    values: torch.Tensor | None = None  # the critic's old values (advantage_estimator="ppo"), [B, L-1]
    # The response's columns, loss tokens or not (multi-turn tool output is in the span, not in the
    # mask): returns are discounted over the span. None: the span is the mask.
    response_span: torch.Tensor | None = None  # [B, L-1] bool
    # [B] long: response columns per row, the compact form of the span (a row's response is its last
    # `span_lengths` scored columns, `lengths - 1 - span_lengths` .. `lengths - 2`). The builders set this
    # instead of `response_span`; `span()` expands it when asked.
    span_lengths: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None  # train/rollout importance weights (mismatch.py), [B, L-1]
    loss_keep: torch.Tensor | None = None  # response_mask minus rejected tokens (mismatch.py), [B, L-1]
    # MoE routing replay (algo.routing_replay): the engine's experts [B, L, layers, k] int16, replayed by
    # every forward over these rows (tasks/model/routing.py).
    routes: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def attention_mask(self) -> torch.Tensor:
        """[B, L] long: 1 on each row's first `lengths` tokens (right padding)."""
        cols = torch.arange(self.tokens.shape[1], device=self.lengths.device)
        return (cols[None, :] < self.lengths[:, None]).long()

    @property
    def position_ids(self) -> torch.Tensor:
        """[B, L] long: `teacher_forced.right_padded`'s (cumsum(mask) - 1).clamp(min=0), i.e. min(j, length - 1)."""
        cols = torch.arange(self.tokens.shape[1], device=self.lengths.device)
        return torch.minimum(cols[None, :], (self.lengths - 1).clamp(min=0)[:, None])

    def response_lengths(self) -> torch.Tensor:
        """[B] float32: loss tokens per row."""
        return self.response_mask.sum(dim=1, dtype=torch.float32)

    def span(self) -> torch.Tensor:
        """[B, L-1] bool: the response's columns (`response_span`, else from `span_lengths`, else the mask)."""
        if self.response_span is not None:
            return self.response_span
        if self.span_lengths is None:
            return self.response_mask > 0
        target = torch.arange(self.tokens.shape[1] - 1, device=self.lengths.device)[None, :]
        end = (self.lengths - 1)[:, None]
        return (target >= end - self.span_lengths[:, None]) & (target < end)

    def select(self, rows: slice) -> "TrainBatch":
        """A row slice; every tensor field is sliced, scalars are kept."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            out[field.name] = value[rows] if isinstance(value, torch.Tensor) else value
        return TrainBatch(**out)


def batch_from_samples(samples: list[Sample], *, group_size: int, routes: bool = False) -> TrainBatch:
    """`routes`: carry every sample's routed experts (checked: missing, all-zero or truncated ones fail)."""
    if not samples:
        raise ValueError("cannot train on an empty rollout: no samples")
    if len(samples) % group_size:
        raise ValueError(f"{len(samples)} samples is not a multiple of n_samples_per_prompt={group_size}")
    # The one padding rule, shared with the hf engine's teacher-forced log-probs (bitwise equal layouts).
    padded = right_padded([s.tokens for s in samples])
    width = padded.tokens.shape[1]
    n = len(samples)
    resp_mask = torch.zeros((n, width - 1), dtype=torch.bool)
    rollout_lp = torch.zeros((n, width - 1), dtype=torch.float32)
    rewards = torch.zeros(n, dtype=torch.float64)
    truncated = torch.zeros(n, dtype=torch.bool)
    for row, s in enumerate(samples):
        s.validate()
        start = s.prompt_length - 1  # column that predicts the first response token
        if s.response_length:
            cols = slice(start, start + s.response_length)
            resp_mask[row, cols] = torch.tensor(s.loss_mask) != 0
            rollout_lp[row, cols] = torch.tensor(s.rollout_log_probs, dtype=torch.float32)
        rewards[row] = s.scalar_reward()
        truncated[row] = s.status == Status.TRUNCATED
    return TrainBatch(
        tokens=padded.tokens.to(torch.int32),
        lengths=padded.attention_mask.sum(dim=1),
        response_mask=resp_mask,
        rewards=rewards,
        rollout_log_probs=rollout_lp,
        group_size=group_size,
        truncated=truncated,
        span_lengths=torch.tensor([s.response_length for s in samples], dtype=torch.long),
        routes=batch_routes(
            [None if s.routed_experts is None else np.asarray(s.routed_experts, dtype=np.int16) for s in samples],
            [len(s.tokens) for s in samples],
            width,
        )
        if routes
        else None,
    )


def per_sample(values: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Dense [B, L-1] -> one 1-D tensor of the masked entries per row."""
    return [values[row][mask[row] > 0] for row in range(values.shape[0])]


def to_dense(rows: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """Inverse of `per_sample`."""
    out = torch.zeros(mask.shape, dtype=rows[0].dtype if rows else torch.float32)
    for row, values in enumerate(rows):
        out[row][mask[row] > 0] = values.to(out.dtype)
    return out
