"""`--dump-details`: per-token train tensors of one rollout as parquet (readable by pandas/duckdb)."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq

from rollflow.tasks.train.batch import TrainBatch, per_sample

DUMP_COLUMNS = ("log_probs", "ref_log_probs", "rollout_log_probs", "advantages", "returns", "values")


def train_dump_bytes(batch: TrainBatch, rollout_id: int) -> bytes:
    """One row per sample; list columns hold the response tokens' values (loss-masked tokens only)."""
    mask = batch.response_mask
    columns: dict[str, list] = {
        "rollout_id": [rollout_id] * batch.size,
        "row": list(range(batch.size)),
        "reward": batch.rewards.tolist(),
        "loss_mask": [m[m > 0].float().tolist() for m in mask],  # float, as written before masks were bool
    }
    for name in DUMP_COLUMNS:
        values = getattr(batch, name)
        columns[name] = [v.tolist() for v in per_sample(values, mask)] if values is not None else [None] * batch.size
    buf = io.BytesIO()
    pq.write_table(pa.table(columns), buf)
    return buf.getvalue()
