"""Micro-batches through Megatron's own schedule (`get_forward_backward_func`), with the loss scaled right.

How the gradient stays that of the single-rank objective:

- rollflow's objective (`objective.micro_batch_objective`) returns each micro-batch's SHARE of the
  mini-batch loss: it divides by the whole mini-batch's token / sample counts, so the shares of all
  micro-batches on all data-parallel ranks add up to the single-rank loss;
- Megatron's schedule divides each micro-batch's loss by the number of micro-batches (and multiplies it
  by the context-parallel size), and its DistributedDataParallel scales the reduced gradient by
  1 / (data-parallel size x context-parallel size), i.e. it averages;
- so the loss handed to the schedule is the share times `schedule_loss_scale(num_microbatches, dp)` =
  num_microbatches x dp, which turns Megatron's mean back into the sum the objective needs, for any
  DP x micro-batch split (tests/test_megatron_parallel.py: DP=1 vs DP=2, 1 vs 4 micro-batches).

Every micro-batch of one call has the same [rows, width] (pipeline stages exchange fixed-shape
activations): short micro-batches are padded with dummy rows and the width is padded to a multiple of
the TP size under sequence parallelism; padding is right-side, so causal attention keeps the real
positions' outputs unchanged, and the loss reads the real rows and columns only.

Packed micro-batches (`train.megatron.packing='thd'`): the real tokens of a micro-batch's rows are laid
end to end as one sequence [1, T] (no padding to the longest row), with `PackedSeqParams` (THD format:
cumulative row lengths) telling attention and RoPE where each row starts, so no row sees another. T is
rounded up to the width multiple; under pipeline parallelism every micro-batch of a call is padded to the
same T. The padding is one extra segment that attends only to itself. The log-probs are gathered back
into the rows' [rows, width - 1] target-aligned layout, so the loss code is the same for both layouts.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from rollflow.tasks.train.batch import TrainBatch
from rollflow.tasks.train.megatron import context_parallel as cpl


def schedule_loss_scale(num_microbatches: int, data_parallel_size: int) -> float:
    """Factor on a micro-batch's loss share that undoes Megatron's mean over micro-batches and DP ranks."""
    if num_microbatches < 1 or data_parallel_size < 1:
        raise ValueError(
            f"num_microbatches={num_microbatches} and data_parallel_size={data_parallel_size} must be >= 1"
        )
    return float(num_microbatches * data_parallel_size)


@dataclasses.dataclass(frozen=True)
class ModelInput:
    """One micro-batch as the model sees it: padded tokens / positions, and the real rows' TrainBatch."""

    tokens: torch.Tensor  # [rows, width] long; packed: [1, T]
    position_ids: torch.Tensor  # [rows, width] long; packed: [1, T], restarting at 0 in every row
    micro: TrainBatch  # the real rows (may be empty: a rank with no rows still joins the collectives)
    width: int  # real width L of `micro`
    packed: Any = None  # PackedRows (THD) when the rows are packed end to end, else None
    row_starts: torch.Tensor | None = None  # packed: [rows] long, each real row's first index (device)
    row_lengths: torch.Tensor | None = None  # packed: [rows] long, each real row's token count (device)
    # context parallel (`split_context`): `tokens` / `position_ids` are this cp rank's positions only;
    cp_targets: torch.Tensor | None = None  # the next token of each of those positions, from the whole sequence
    cp_order: torch.Tensor | None = None  # whole-sequence order of the cp ranks' positions laid end to end
    cp: int = 1

    @property
    def n_real(self) -> int:
        return self.micro.size

    @property
    def seq_length(self) -> int:
        """The whole sequence's length (the schedule divides it by cp for the activations' shape)."""
        return self.tokens.shape[1] * self.cp


def trim_width(micro: TrainBatch, width: int) -> TrainBatch:
    """The first `width` token columns of a right-padded batch (`width - 1` of the target-aligned fields)."""
    full = micro.tokens.shape[1]
    out = {}
    for field in dataclasses.fields(micro):
        value = getattr(micro, field.name)
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] in (full, full - 1):
            value = value[:, : width - (full - value.shape[1])]
        out[field.name] = value
    return TrainBatch(**out)


def token_budget_micro_batches(batch: TrainBatch, max_tokens: int, *, packed: bool = False) -> list[TrainBatch]:
    """Consecutive rows grouped so that rows x (longest row of the group) <= max_tokens (packed: the sum of
    the rows' lengths <= max_tokens), each group cut to its own longest row: no padding to the longest
    sample of the rollout. A row longer than the budget is a micro-batch of its own."""
    lengths = batch.lengths.tolist()
    groups: list[tuple[int, int, int]] = []  # (start, stop, width)
    start, width, total = 0, 0, 0
    for row, length in enumerate(lengths):
        wider = max(width, length)
        cost = total + length if packed else (row - start + 1) * wider
        if row > start and cost > max_tokens:
            groups.append((start, row, width))
            start, wider, total = row, length, 0
        width = wider
        total += length
    if lengths:
        groups.append((start, len(lengths), width))
    return [trim_width(batch.select(slice(a, b)), max(w, 2)) for a, b, w in groups]


def model_inputs(
    micros: list[TrainBatch], *, rows: int, width_multiple: int, device: torch.device, empty: TrainBatch
) -> list[ModelInput]:
    """Pad every micro-batch to `rows` rows and a width that is a multiple of `width_multiple`.

    `empty` (a 0-row TrainBatch of the right width) stands in when this rank has no rows at all: the
    schedule still runs one all-padding micro-batch so the gradient reduction has every rank.
    """
    micros = micros or [empty]
    width = micros[0].tokens.shape[1]
    padded_width = -(-width // width_multiple) * width_multiple
    out = []
    for micro in micros:
        tokens = torch.zeros((rows, padded_width), dtype=torch.long)
        tokens[: micro.size, :width] = micro.tokens
        # Positions continue past the real width (right padding; causal attention never looks right).
        positions = torch.arange(padded_width, dtype=torch.long).expand(rows, padded_width).clone()
        positions[: micro.size, :width] = micro.position_ids
        out.append(ModelInput(tokens.to(device), positions.to(device), micro, width))
    return out


@functools.cache  # one class: not a new one for every train call
def packed_rows_class():
    """`PackedSeqParams` plus the row bounds as a Python tuple, so attention can split the packed sequence
    without reading `cu_seqlens` back from the GPU in every layer."""
    from megatron.core.packed_seq_params import PackedSeqParams  # optional dependency: imported on use

    @dataclasses.dataclass
    class PackedRows(PackedSeqParams):
        bounds: tuple[int, ...] = ()
        cp_order: Any = None  # context parallel: the keys' gather order (context_parallel.gather_order)

    return PackedRows


def packed_model_inputs(
    micros: list[TrainBatch],
    *,
    width_multiple: int,
    device: torch.device,
    empty: TrainBatch,
    same_length: bool,
    row_multiple: int = 1,
) -> list[ModelInput]:
    """Each micro-batch's real tokens packed end to end into [1, T] (THD), with the row bounds.

    `same_length`: every micro-batch gets the same T (pipeline stages exchange fixed-shape activations).
    `row_multiple`: each row's segment rounded up to a multiple of it (context parallel: 2 x cp), the extra
    tokens after the row's own (causal attention keeps the real positions' outputs unchanged).
    """
    PackedRows = packed_rows_class()
    micros = micros or [empty]
    segments = [-(-m.lengths.long() // row_multiple) * row_multiple for m in micros]
    sizes = [int(seg.sum()) for seg in segments]
    common = max(sizes) if same_length else None
    out = []
    for micro, size, segment in zip(micros, sizes, segments):
        total = -(-max(common if common is not None else size, 1) // width_multiple) * width_multiple
        lengths = micro.lengths.long()
        tokens = torch.zeros((1, total), dtype=torch.long)
        positions = torch.zeros((1, total), dtype=torch.long)
        bounds = [0] + torch.cumsum(segment, dim=0).tolist()
        if row_multiple == 1:
            keep = micro.attention_mask.bool()  # right-padded rows: row-major order is the rows end to end
            tokens[0, :size] = micro.tokens[keep]
            positions[0, :size] = micro.position_ids[keep]
        else:
            for row, (start, length, seg) in enumerate(zip(bounds, lengths.tolist(), segment.tolist())):
                tokens[0, start : start + length] = micro.tokens[row, :length]
                positions[0, start : start + seg] = torch.arange(seg) + int(micro.position_ids[row, 0])
        if total > size:  # the padding: one more segment, attending only to itself
            positions[0, size:] = torch.arange(total - size)
            bounds.append(total)
        cu = torch.tensor(bounds, dtype=torch.int32, device=device)
        longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        packed = PackedRows(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
            bounds=tuple(bounds),
        )
        starts = torch.tensor(bounds[: micro.size], dtype=torch.long)
        out.append(
            ModelInput(
                tokens.to(device),
                positions.to(device),
                micro,
                micro.tokens.shape[1],
                packed,
                starts.to(device),
                lengths.to(device),
            )
        )
    return out


def split_context(item: ModelInput, cp: int, rank: int) -> ModelInput:
    """This cp rank's share of a whole micro-batch (context_parallel.py's layout): its positions' tokens, and
    the next token of each from the whole sequence (the last position has none; it is never scored). A packed
    micro-batch keeps the whole sequence's row bounds: attention and RoPE read them."""
    tokens = item.tokens
    following = torch.cat([tokens[:, 1:], tokens.new_zeros((tokens.shape[0], 1))], dim=1)
    if item.packed is None:
        positions, order = cpl.padded_layout(tokens.shape[1], cp, rank)
    else:
        by_rank = [cpl.packed_zigzag_positions(item.packed.bounds, cp, r) for r in range(cp)]
        positions, order = by_rank[rank], cpl.gather_order(by_rank)
    index, order = positions.to(tokens.device), order.to(tokens.device)
    packed = None if item.packed is None else dataclasses.replace(item.packed, cp_order=order)
    return dataclasses.replace(
        item,
        tokens=tokens[:, index],
        position_ids=item.position_ids[:, index],
        packed=packed,
        cp_targets=following[:, index],
        cp_order=order,
        cp=cp,
    )


def unpack_token_values(values: torch.Tensor, item: ModelInput) -> torch.Tensor:
    """Per-position values of a packed sequence ([T - 1]: position p scores token p + 1) in the rows'
    target-aligned [rows, width - 1] layout; columns past a row's end are 0 (the loss masks them)."""
    cols = torch.arange(item.width - 1, device=values.device)
    index = (item.row_starts[:, None] + cols[None, :]).clamp(max=values.shape[0] - 1)
    inside = cols[None, :] < (item.row_lengths - 1)[:, None]
    return torch.where(inside, values[index], values.new_zeros(()))


def run_schedule(
    model_chunks: list[torch.nn.Module],
    inputs: list[ModelInput],
    loss_fn: Callable[[ModelInput, torch.Tensor, int], tuple[torch.Tensor, dict[str, Any]]],
    *,
    forward_only: bool,
    forward_kwargs: dict[str, Any] | None = None,
    on_micro_batch: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:
    """Forward (and backward) of `inputs` through Megatron's schedule for this parallel layout.

    `loss_fn(item, output, num_microbatches) -> (loss, data)` runs on the last pipeline stage on the
    model's output (logits); `data` of each micro-batch is returned there, in order ([] elsewhere).
    `forward_kwargs` go to every model call (e.g. megatron-core 0.19's `output_processor`).
    `on_micro_batch()` runs once per micro-batch, at its forward through the first model chunk (the
    backend's progress tick: a pipeline step can run for minutes and must still show signs of life).
    """
    extra = dict(forward_kwargs or {})
    from megatron.core.pipeline_parallel import get_forward_backward_func  # optional dependency: imported on use

    num_microbatches = len(inputs)

    def forward_step(data_iterator, model):
        item = next(data_iterator)
        if on_micro_batch is not None and model is model_chunks[0]:  # interleaved: each chunk sees every item
            on_micro_batch()
        packed = {"packed_seq_params": item.packed} if item.packed is not None else {}
        output = model(input_ids=item.tokens, position_ids=item.position_ids, attention_mask=None, **packed, **extra)

        def loss_func(output_tensor):
            return loss_fn(item, output_tensor, num_microbatches)

        return output, loss_func

    rows, width = inputs[0].tokens.shape[0], inputs[0].seq_length
    # Interleaved stages: one iterator per model chunk, each over the same micro-batches.
    data = iter(inputs) if len(model_chunks) == 1 else [iter(inputs) for _ in model_chunks]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data,
        model=model_chunks,
        num_microbatches=num_microbatches,
        seq_length=width,
        micro_batch_size=rows,
        forward_only=forward_only,
    )
