"""`TrainBatch` straight from an artifact's columns: numpy over the flat token buffers, no `Sample`s.

Bitwise the batch `batch_from_samples` builds from the same rows (a test checks every tensor): the
same right padding (`teacher_forced.right_padded`), position ids by the same torch ops, the same
float64 -> float32 rounding of log-probs. It lives beside batch.py rather than in it so the two
builders can change independently; both return batch.py's `TrainBatch`.
"""

from __future__ import annotations

import numpy as np
import torch

from rollflow.artifacts.columns import SampleColumns
from rollflow.artifacts.sample import Status
from rollflow.tasks.model.routing import batch_routes
from rollflow.tasks.train.batch import TrainBatch

# Cells of the padded layout filled per block of rows in `batch_from_columns` (bounds its temporaries).
BLOCK_TOKENS = 1 << 22


def batch_from_columns(
    columns: SampleColumns, *, group_size: int, reward_key: str | None = None, routes: bool = False
) -> TrainBatch:
    """The train batch of a rollout held as columns. `reward_key`: the run's key for dict rewards (wins over
    each sample's own, as slime's --reward-key); None keeps the samples' keys, as `batch_from_samples`.
    `routes`: carry every row's routed experts (checked: missing, all-zero or truncated ones fail)."""
    n = len(columns)
    if not n:
        raise ValueError("cannot train on an empty rollout: no samples")
    if n % group_size:
        raise ValueError(f"{n} samples is not a multiple of n_samples_per_prompt={group_size}")
    invalid = columns.first_invalid()
    if invalid is not None:
        raise ValueError(invalid[1])  # Sample.validate's message for that row
    chunks = columns.chunks()
    lengths = np.concatenate([chunk.list_column("tokens").lengths for _, chunk in chunks])
    resp = columns.numpy("response_length").astype(np.int64)
    no_prompt = np.flatnonzero((resp > 0) & (resp == lengths))
    if len(no_prompt):
        row = int(no_prompt[0])
        raise ValueError(
            f"samples[{row}]: a response needs at least one prompt token before it (tokens are "
            "prompt + response; the first response token is scored from the last prompt token)"
        )
    width = int(lengths.max())
    cols = np.arange(width)
    ids = np.zeros((n, width), dtype=np.int32)  # the column's own dtype: no widening of the rollout
    # Target-aligned [n, L-1]: column j scores token j + 1, so a row's response is scored at columns
    # prompt_length - 1 ... length - 2.
    response_mask = np.zeros((n, width - 1), dtype=bool)
    rollout_lp = np.zeros((n, width - 1), dtype=np.float32)
    # Chunk by chunk (parquet row groups), a bounded block of rows at a time, so the masks and the
    # boolean-index temporaries (numpy builds index arrays for a masked assignment) stay small beside the
    # batch. A boolean mask's true cells in row-major order are the flat buffer's order: one masked
    # assignment scatters a block's rows at once.
    for first, chunk in chunks:
        tokens, loss_mask, log_probs = (chunk.list_column(k) for k in ("tokens", "loss_mask", "rollout_log_probs"))
        block = max(1, BLOCK_TOKENS // width)
        for lo in range(0, len(chunk), block):
            hi = min(lo + block, len(chunk))
            rows = slice(first + lo, first + hi)
            length, r = lengths[rows], resp[rows]
            ids[rows][cols[None, :] < length[:, None]] = tokens.values[tokens.offsets[lo] : tokens.offsets[hi]]
            start = length - r - 1
            target = cols[None, :-1]
            in_span = (target >= start[:, None]) & (target < (start + r)[:, None])
            response_mask[rows][in_span] = loss_mask.values[loss_mask.offsets[lo] : loss_mask.offsets[hi]] != 0
            # float64 -> float32 rounds to nearest, as torch.tensor(list_of_floats, dtype=float32) does
            rollout_lp[rows][in_span] = log_probs.values[log_probs.offsets[lo] : log_probs.offsets[hi]]
    return TrainBatch(
        tokens=torch.from_numpy(ids),
        lengths=torch.from_numpy(lengths.astype(np.int64)),  # mask and positions follow (TrainBatch properties)
        response_mask=torch.from_numpy(response_mask),
        rewards=torch.from_numpy(columns.scalar_rewards(reward_key)),
        rollout_log_probs=torch.from_numpy(rollout_lp),
        group_size=group_size,
        truncated=torch.from_numpy(np.array(columns.status_is(Status.TRUNCATED), dtype=bool)),
        span_lengths=torch.from_numpy(resp),  # the span follows (TrainBatch.span)
        # One small array per row (rows x layers x k), never per token in Python.
        routes=batch_routes(columns.routed_experts_rows(), lengths.tolist(), width) if routes else None,
    )


def identical_group_fraction_of_columns(columns: SampleColumns, group_size: int) -> float:
    """`tasks.groups.identical_group_fraction` over the token rows of `columns`, compared in numpy: share of
    prompt groups (consecutive runs of `group_size` rows) whose token sequences are all equal."""
    n_groups = len(columns) // group_size if group_size > 1 else 0
    if not n_groups:
        return 0.0
    chunks = columns.chunks()
    starts = np.array([start for start, _ in chunks])
    lists = [chunk.list_column("tokens") for _, chunk in chunks]

    def row(i: int) -> np.ndarray:  # a zero-copy view of row i's tokens, whichever row group holds it
        c = int(np.searchsorted(starts, i, side="right") - 1)
        return lists[c].row(i - int(starts[c]))

    identical = 0
    for g in range(n_groups):  # per group, never per token
        seqs = [row(i) for i in range(g * group_size, (g + 1) * group_size)]
        if all(len(seq) == len(seqs[0]) and np.array_equal(seq, seqs[0]) for seq in seqs[1:]):
            identical += 1
    return identical / n_groups
