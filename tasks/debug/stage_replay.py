"""Stage replay with expected values: compare a recomputed stage with what the run recorded.

Pure comparisons (no Prefect, no Ray, no model): the flow (flows/stage_replay.py) recomputes a stage on the
pinned artifacts and hands both sides here. Each stage reads the recorded outputs of the stage before it, so
a mismatch names the first stage whose code or config changed, not every stage downstream of it.

    reward     the reward function over the artifact's samples   vs Sample.reward
    advantage  advantages from the artifact's rewards              vs the per-sample train records
    loss       one iteration's training from its checkpoint        vs metrics.jsonl, train_steps.jsonl, records
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

Stage = Literal["reward", "advantage", "loss"]
STAGES: tuple[Stage, ...] = ("reward", "advantage", "loss")


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """|replayed - recorded| <= atol + rtol * |recorded|."""

    atol: float
    rtol: float

    def close(self, recorded: float, replayed: float) -> bool:
        if math.isnan(recorded) or math.isnan(replayed):
            return math.isnan(recorded) and math.isnan(replayed)
        if math.isinf(recorded) or math.isinf(replayed):
            return recorded == replayed
        return abs(replayed - recorded) <= self.atol + self.rtol * abs(recorded)


# A replay on the same machine and thread count is usually bitwise equal; the bounds leave room for another
# BLAS or thread layout, and stay far below what a changed reward or loss coefficient moves (>= 1e-3 relative).
TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(atol=1e-12, rtol=1e-9),
    "float32": Tolerance(atol=1e-6, rtol=1e-5),
    "bfloat16": Tolerance(atol=1e-3, rtol=2e-2),
    "float16": Tolerance(atol=1e-4, rtol=5e-3),
}
EXACT = Tolerance(atol=0.0, rtol=0.0)  # rewards: Python floats from a deterministic function


def tolerance_for(dtype: str) -> Tolerance:
    try:
        return TOLERANCES[dtype]
    except KeyError:
        raise ValueError(f"no stage-replay tolerance for dtype {dtype!r}; known: {sorted(TOLERANCES)}") from None


# Recorded figures that depend on wall time or on where the run happened, never compared.
NOT_REPLAYED_PREFIXES = ("perf/", "sync/", "eval/", "pipeline/")
# `step` numbers optimizer steps over the whole run; a replay of one iteration counts from 1.
NOT_REPLAYED_KEYS = frozenset({"train/n_samples", "train/step_s", "train/seconds", "step", "iteration", "rollout_id"})


@dataclasses.dataclass(frozen=True)
class Mismatch:
    stage: Stage
    rollout_id: int
    field: str
    where: str  # "sample 12", "step 3", "iteration" ...
    recorded: float | None
    replayed: float | None

    @property
    def abs_diff(self) -> float | None:
        if self.recorded is None or self.replayed is None:
            return None
        return abs(self.replayed - self.recorded)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"abs_diff": self.abs_diff}


@dataclasses.dataclass
class StageResult:
    stage: Stage
    rollout_id: int
    compared: int  # values compared
    mismatches: list[Mismatch]

    @property
    def ok(self) -> bool:
        return not self.mismatches and self.compared > 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "rollout_id": self.rollout_id,
            "compared": self.compared,
            "ok": self.ok,
            "mismatches": [m.to_dict() for m in self.mismatches],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StageResult":
        fields = ("stage", "rollout_id", "field", "where", "recorded", "replayed")
        return cls(
            data["stage"],
            int(data["rollout_id"]),
            int(data["compared"]),
            [Mismatch(**{k: m[k] for k in fields}) for m in data.get("mismatches", [])],
        )


def _num(value: Any) -> float | None:
    return None if value is None else float(value)


def compare_values(
    stage: Stage,
    rollout_id: int,
    field: str,
    recorded: Sequence[Any],
    replayed: Sequence[Any],
    tol: Tolerance,
    *,
    label: str = "sample",
) -> StageResult:
    """Position by position; a length difference is one mismatch (named by the lengths)."""
    if len(recorded) != len(replayed):
        return StageResult(
            stage,
            rollout_id,
            1,
            [Mismatch(stage, rollout_id, f"{field} (count)", "all", float(len(recorded)), float(len(replayed)))],
        )
    out = []
    compared = 0
    for index, (a, b) in enumerate(zip(recorded, replayed)):
        a, b = _num(a), _num(b)
        if a is None and b is None:
            continue
        compared += 1
        if a is None or b is None or not tol.close(a, b):
            out.append(Mismatch(stage, rollout_id, field, f"{label} {index}", a, b))
    return StageResult(stage, rollout_id, compared, out)


def merge(stage: Stage, rollout_id: int, parts: Iterable[StageResult]) -> StageResult:
    parts = list(parts)
    return StageResult(stage, rollout_id, sum(p.compared for p in parts), [m for p in parts for m in p.mismatches])


def replayed_metric_keys(recorded: Mapping[str, Any], replayed: Mapping[str, Any]) -> list[str]:
    """Numeric keys both sides have, minus timings and figures of other stages."""
    keys = []
    for key in sorted(set(recorded) & set(replayed)):
        if key.startswith(NOT_REPLAYED_PREFIXES) or key in NOT_REPLAYED_KEYS or key.endswith("_s"):
            continue
        if isinstance(recorded[key], (int, float)) and isinstance(replayed[key], (int, float)):
            keys.append(key)
    return keys


def compare_metrics(
    stage: Stage,
    rollout_id: int,
    recorded: Mapping[str, Any],
    replayed: Mapping[str, Any],
    tol: Tolerance,
    *,
    where: str = "iteration",
) -> StageResult:
    out, keys = [], replayed_metric_keys(recorded, replayed)
    for key in keys:
        a, b = float(recorded[key]), float(replayed[key])
        if not tol.close(a, b):
            out.append(Mismatch(stage, rollout_id, key, where, a, b))
    return StageResult(stage, rollout_id, len(keys), out)


def compare_steps(
    rollout_id: int, recorded: Sequence[Mapping[str, Any]], replayed: Sequence[Mapping[str, Any]], tol: Tolerance
) -> StageResult:
    """Each optimizer step's statistics (train_steps.jsonl rows vs the replay's steps, in order)."""
    if len(recorded) != len(replayed):
        return StageResult(
            "loss",
            rollout_id,
            1,
            [
                Mismatch(
                    "loss", rollout_id, "optimizer steps (count)", "all", float(len(recorded)), float(len(replayed))
                )
            ],
        )
    return merge(
        "loss",
        rollout_id,
        (
            compare_metrics("loss", rollout_id, a, b, tol, where=f"step {i + 1}")
            for i, (a, b) in enumerate(zip(recorded, replayed))
        ),
    )


@dataclasses.dataclass
class StageReplayReport:
    source_run: str
    results: list[StageResult]

    @property
    def mismatches(self) -> list[Mismatch]:
        return [m for r in self.results for m in r.mismatches]

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(r.ok for r in self.results)

    def summary(self) -> str:
        if self.ok:
            n = sum(r.compared for r in self.results)
            return f"stage replay of run {self.source_run!r}: {n} values match ({len(self.results)} stage runs)"
        bad = sorted({(r.stage, r.rollout_id) for r in self.results if not r.ok})
        empty = [
            f"{s} {i}" for s, i in bad if not any(r.compared for r in self.results if (r.stage, r.rollout_id) == (s, i))
        ]
        text = f"stage replay of run {self.source_run!r}: {len(self.mismatches)} mismatches in " + ", ".join(
            f"{s} (rollout {i})" for s, i in bad
        )
        return text + (f"; nothing recorded to compare for {', '.join(empty)}" if empty else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "source_run": self.source_run,
            "ok": self.ok,
            "summary": self.summary(),
            "results": [r.to_dict() for r in self.results],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StageReplayReport":
        return cls(data["source_run"], [StageResult.from_dict(r) for r in data.get("results", [])])

    def table_rows(self, limit: int | None = None) -> list[dict[str, Any]]:
        rows = [m.to_dict() for m in self.mismatches]
        return rows if limit is None else rows[:limit]
