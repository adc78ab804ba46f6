"""What off-policy pipelining records in a sample's metadata, and how readers get it back.

Kept in `metadata` (the contract's JSON extension point) rather than new columns, so artifacts written
by async runs stay readable by every existing reader, and slime's dumps import unchanged.

- `filtered`: why a sample is in the artifact but not in the trained batch (its whole prompt group
  carries the same reason): `filter` (failed the dynamic-sampling group filter), `surplus` (passed,
  but the batch already had its groups), `aborted` (partial rollout: continued in the next rollout),
  `stale` (a continuation would exceed pipeline.max_staleness). Replay drops exactly these rows again.
- `weight_versions`: one weight version per response token, present only when a sample's tokens came
  from more than one version (a partial rollout continued under new weights); otherwise every token
  has the sample's `weight_version`.
- `continued_from`: {"rollout_id", "index"} of the aborted sample a continued one grew from.
- `waited_at_sync`: true on the samples of a cut group finished before the weight sync rather than continued
  later (pipeline.stale_policy=wait: a continuation would have exceeded pipeline.max_staleness).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow.compute as pc

from .columns import SampleColumns
from .sample import Sample

FILTERED = "filtered"
WEIGHT_VERSIONS = "weight_versions"
CONTINUED_FROM = "continued_from"
WAITED = "waited_at_sync"
FILTER_REASONS = ("filter", "surplus", "aborted", "stale")


def filtered_reason(sample: Sample) -> str | None:
    reason = sample.metadata.get(FILTERED)
    return str(reason) if reason else None


def mark_filtered(samples: list[Sample], reason: str) -> list[Sample]:
    """The samples (a whole group) with `filtered = reason`, copies: the inputs are not touched."""
    if reason not in FILTER_REASONS:
        raise ValueError(f"unknown filter reason {reason!r}; expected one of {FILTER_REASONS}")
    return [dataclasses.replace(s, metadata={**s.metadata, FILTERED: reason}) for s in samples]


def token_weight_versions(sample: Sample) -> list[int]:
    """The weight version of each response token."""
    versions = sample.metadata.get(WEIGHT_VERSIONS)
    if versions is None:
        return [int(sample.weight_version)] * sample.response_length
    if len(versions) != sample.response_length:
        raise ValueError(
            f"Sample (group {sample.group_index}, index {sample.index}): metadata.weight_versions has "
            f"{len(versions)} entries for response_length={sample.response_length}"
        )
    return [int(v) for v in versions]


def weight_version_text(sample: Sample) -> str:
    """The response tokens' weight versions as runs: "3" when all share one, else "v2x12+v3x40"."""
    versions = sample.metadata.get(WEIGHT_VERSIONS)
    if not versions:
        return str(sample.weight_version)
    runs: list[list[int]] = []
    for v in versions:
        if runs and runs[-1][0] == int(v):
            runs[-1][1] += 1
        else:
            runs.append([int(v), 1])
    return "+".join(f"v{v}x{n}" for v, n in runs)


def oldest_weight_version(sample: Sample) -> int:
    versions = sample.metadata.get(WEIGHT_VERSIONS)
    return int(min(versions)) if versions else int(sample.weight_version)


def _metadata_rows(columns: SampleColumns, key: str) -> tuple[np.ndarray, list[dict]]:
    """Rows whose metadata JSON mentions `key`, and their parsed metadata (JSON parsed for those rows only)."""
    metadata = columns.table.column("metadata")
    rows = np.flatnonzero(pc.match_substring(metadata, json.dumps(key)).to_numpy(zero_copy_only=False))
    texts = metadata.take(rows).to_pylist() if len(rows) else []
    return rows, [json.loads(text) for text in texts]


def filtered_mask(columns: SampleColumns) -> np.ndarray:
    """True for rows marked `filtered` (not trained)."""
    mask = np.zeros(len(columns), dtype=bool)
    rows, metas = _metadata_rows(columns, FILTERED)
    for row, meta in zip(rows.tolist(), metas):
        mask[row] = bool(meta.get(FILTERED))
    return mask


def trained_rows(columns: SampleColumns) -> SampleColumns:
    """The rows a trainer trains on: every row not marked `filtered` (the columns themselves when none is)."""
    mask = filtered_mask(columns)
    return columns.take(np.flatnonzero(~mask)) if mask.any() else columns


@dataclasses.dataclass(frozen=True)
class PipelineStats:
    """Per-rollout figures of async training (metrics `pipeline/*`)."""

    staleness_mean: float  # trainer version - token version, mean over trained response tokens
    staleness_max: int
    oldest_weight_version: int
    filtered_groups: dict[str, int]  # reason -> groups
    continued_samples: int
    versions_per_sample_max: int = 1  # distinct weight versions in one trained sample (1: never continued)
    dropped_samples: int = 0  # rows of groups marked `stale` (pipeline.stale_policy=drop)
    waited_samples: int = 0  # rows finished before a sync instead of continued (pipeline.stale_policy=wait)

    def metrics(self) -> dict[str, float]:
        out = {
            "pipeline/staleness_mean": self.staleness_mean,
            "pipeline/staleness_max": float(self.staleness_max),
            "pipeline/oldest_weight_version": float(self.oldest_weight_version),
            "pipeline/continued_samples": float(self.continued_samples),
            "pipeline/versions_per_sample_max": float(self.versions_per_sample_max),
            "pipeline/dropped_samples": float(self.dropped_samples),
            "pipeline/waited_samples": float(self.waited_samples),
        }
        out.update(
            {
                f"pipeline/filtered_groups_{reason}": float(self.filtered_groups.get(reason, 0))
                for reason in FILTER_REASONS
            }
        )
        return out


def pipeline_stats(columns: SampleColumns, trainer_version: int, group_size: int) -> PipelineStats:
    """Staleness of the trained tokens against the trainer's `trainer_version`, filtered groups, continuations."""
    versions = columns.numpy("weight_version").astype(np.int64)
    lengths = columns.numpy("response_length").astype(np.int64)
    per_token: dict[int, list[int]] = {}
    continued = 0
    rows, metas = _metadata_rows(columns, WEIGHT_VERSIONS)
    for row, meta in zip(rows.tolist(), metas):
        if meta.get(WEIGHT_VERSIONS):
            per_token[row] = [int(v) for v in meta[WEIGHT_VERSIONS]]
    rows, metas = _metadata_rows(columns, CONTINUED_FROM)
    continued = sum(1 for meta in metas if meta.get(CONTINUED_FROM))
    mask = filtered_mask(columns)
    reasons: dict[str, int] = {}
    rows, metas = _metadata_rows(columns, FILTERED)
    seen_groups: set[int] = set()
    dropped = 0
    for row, meta in zip(rows.tolist(), metas):
        reason = meta.get(FILTERED)
        group = row // max(1, group_size)
        dropped += reason == "stale"
        if reason and group not in seen_groups:
            seen_groups.add(group)
            reasons[str(reason)] = reasons.get(str(reason), 0) + 1
    _rows, metas = _metadata_rows(columns, WAITED)
    waited = sum(1 for meta in metas if meta.get(WAITED))
    total, count, worst, oldest, spans = 0, 0, 0, None, 1
    for row in np.flatnonzero(~mask).tolist():
        tokens = per_token.get(row) or [int(versions[row])] * int(lengths[row])
        spans = max(spans, len(set(tokens)))
        for v in tokens:
            total += trainer_version - v
        count += len(tokens)
        if tokens:
            worst = max(worst, trainer_version - min(tokens))
            oldest = min(tokens) if oldest is None else min(oldest, min(tokens))
    return PipelineStats(
        staleness_mean=total / count if count else 0.0,
        staleness_max=worst,
        oldest_weight_version=int(oldest if oldest is not None else trainer_version),
        filtered_groups=reasons,
        continued_samples=continued,
        versions_per_sample_max=spans,
        dropped_samples=dropped,
        waited_samples=waited,
    )
