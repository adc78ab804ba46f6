"""The teacher-forced log-prob computation, shared by the torch trainer and the `hf` engine.

The trainer scores a rollout with one forward over the whole rollout: sequences right-padded to the
longest one, position ids from the mask (cumsum - 1), rows split into micro-batches of
`micro_batch_size`, logits cast to fp32 and divided by the temperature. Log-probs taken while
sampling (KV cache, one step at a time, left padding) differ from that by up to ~1e-5 in fp32 and ~1e-2 in
bf16. With `rollout.logprobs='teacher_forced'` the engine rescores its samples with *these*
functions, on the same rows in the same order, so both sides run the same kernels on the same
shapes and their log-probs are bitwise equal (docs/architecture.md section 10, "Log-prob exactness").

It lives below tasks/rollout and tasks/train (which never import each other): one copy of the
numerics, not two that drift.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import torch

from rollflow.tasks.model.routing import replay_routes


@dataclasses.dataclass(frozen=True)
class ScoringLayout:
    """What the engine must reproduce of the trainer's scoring forward (built from train.* settings)."""

    micro_batch_size: int  # train.micro_batch_size: rows per forward
    threads: int  # train.threads: CPU reductions may depend on the thread count
    dtype: str  # train.dtype: the engine's model must already be in it (checked)
    device: str  # train.device: same device type, same kernels

    @classmethod
    def of(cls, train) -> "ScoringLayout":
        """From the trainer's settings (`train`: an OptimConfig, or anything with these four fields)."""
        return cls(
            micro_batch_size=int(train.micro_batch_size),
            threads=int(train.threads),
            dtype=str(train.dtype),
            device=str(train.device),
        )


@dataclasses.dataclass(frozen=True)
class Padded:
    """Right-padded token rows: the layout of `TrainBatch` (tokens, attention_mask, position_ids)."""

    tokens: torch.Tensor  # [B, L] long, 0 after each row's end
    attention_mask: torch.Tensor  # [B, L] long
    position_ids: torch.Tensor  # [B, L] long, cumsum(mask) - 1, clamped at 0


def right_padded(sequences: list[list[int]]) -> Padded:
    """Rows padded to the longest one. The trainer and the engine both build their input here.

    Filled through one boolean mask over a flat array rather than a tensor per row: the engine's rescoring pays
    this on every rollout, and per row it cost ~25 ms for the demo's 2,048 short samples (~1 ms this way)."""
    lengths = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
    flat = np.fromiter(itertools.chain.from_iterable(sequences), dtype=np.int64, count=int(lengths.sum()))
    filled = np.arange(int(lengths.max())) < lengths[:, None]  # row-major: each row's tokens in order
    tokens = np.zeros(filled.shape, dtype=np.int64)
    tokens[filled] = flat
    attn = torch.from_numpy(filled.astype(np.int64))
    position_ids = (attn.cumsum(dim=1) - 1).clamp(min=0)
    return Padded(torch.from_numpy(tokens), attn, position_ids)


def next_token_logits(
    model,
    tokens: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    temperature: float,
    routes: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 logits of every next token divided by the temperature, target aligned [B, L-1, V], on the
    model's device. Column j scores tokens[:, j + 1]. `routes` [B, L, layers, k]: an MoE model routes
    with the rollout's experts (tasks/model/routing.py), not its own."""
    device = next(model.parameters()).device
    with replay_routes(model, routes):
        out = model(
            input_ids=tokens.to(device, torch.long),  # a TrainBatch may hold int32 ids
            attention_mask=attention_mask.to(device),
            position_ids=position_ids.to(device),
        )
    return out.logits[:, :-1].float() / temperature


def gather_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits) at the next tokens: [B, L-1] (logits from `next_token_logits`)."""
    targets = tokens[:, 1:].to(logits.device, torch.long).unsqueeze(-1)
    return torch.log_softmax(logits, dim=-1).gather(-1, targets).squeeze(-1)


@torch.no_grad()
def teacher_forced_log_probs(
    model,
    tokens: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    temperature: float,
    micro_batch_size: int,
    routes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probs [B, L-1] (fp32, on CPU) of a right-padded batch, scored `micro_batch_size` rows at a time
    in eval mode (no dropout), as the trainer scores old and reference log-probs."""
    was_training = model.training
    model.eval()
    try:
        parts = []
        for start in range(0, tokens.shape[0], micro_batch_size):
            rows = slice(start, start + micro_batch_size)
            micro_routes = None if routes is None else routes[rows]
            logits = next_token_logits(
                model, tokens[rows], attention_mask[rows], position_ids[rows], temperature, micro_routes
            )
            parts.append(gather_log_probs(logits, tokens[rows]))
    finally:
        model.train(was_training)
    return torch.cat(parts, dim=0).cpu()  # one device-to-host copy (and sync) for the batch, not one per micro-batch
