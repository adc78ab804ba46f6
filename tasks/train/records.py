"""Per-sample train records: what `rollflow replay --stage` and the reproducibility gate compare against.

Written for every trained rollout (not only under `--dump-details`), so they must stay cheap: a few numbers
per sample, not per token. Sums run in float64 over the trainer's values, so a record is a deterministic
function of the per-token tensors (bitwise equal tensors give bitwise equal records).
"""

from __future__ import annotations

import dataclasses
import io

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from rollflow.artifacts.store import join_uri, normalize_root
from rollflow.tasks.train.batch import TrainBatch

RECORD_COLUMNS = ("reward", "advantage", "log_prob_sum", "ref_log_prob_sum")


def train_record_uri(root: str, run: str, rollout_id: int) -> str:
    """`{root}/{run}/train_records/{rollout_id:06d}.parquet`: rewritten when a resume redoes the iteration."""
    return join_uri(normalize_root(root), f"{run}/train_records/{rollout_id:06d}.parquet")


@dataclasses.dataclass
class SampleRecords:
    """One value per trained sample and column (None where the trainer did not compute it)."""

    rollout_id: int
    columns: dict[str, list[float | None]]

    @property
    def n_samples(self) -> int:
        return len(self.columns.get("reward", []))


def _masked_sum(values: torch.Tensor | None, mask: torch.Tensor) -> list[float | None]:
    if values is None:
        return [None] * mask.shape[0]
    return (values.double() * mask.double()).sum(dim=1).tolist()


def sample_records(batch: TrainBatch, rollout_id: int) -> SampleRecords:
    """The records of one trained batch. `advantage` is the masked mean: one number for sequence-level
    estimators (grpo: every token carries it), a summary for token-level ones."""
    mask = batch.response_mask.double()
    count = mask.sum(dim=1).clamp(min=1.0)
    adv = batch.advantages
    advantage = [None] * batch.size if adv is None else ((adv.double() * mask).sum(dim=1) / count).tolist()
    return SampleRecords(
        rollout_id,
        {
            "reward": batch.rewards.double().tolist(),
            "advantage": advantage,
            "log_prob_sum": _masked_sum(batch.log_probs, mask),
            "ref_log_prob_sum": _masked_sum(batch.ref_log_probs, mask),
        },
    )


def records_bytes(records: SampleRecords) -> bytes:
    table = pa.table(
        {
            "rollout_id": [records.rollout_id] * records.n_samples,
            "row": list(range(records.n_samples)),
            **{name: pa.array(records.columns[name], pa.float64()) for name in RECORD_COLUMNS},
        }
    )
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def read_records(data: bytes) -> SampleRecords:
    table = pq.read_table(io.BytesIO(data))
    ids = table.column("rollout_id").to_pylist()
    present = [name for name in RECORD_COLUMNS if name in table.column_names]
    return SampleRecords(int(ids[0]) if ids else -1, {name: table.column(name).to_pylist() for name in present})
