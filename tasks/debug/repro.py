"""Bitwise reproducibility gate and group-diversity guard: pure comparisons of two runs of one config.

The flow (flows/repro_gate.py) runs the same short config twice in fresh workers and reads back what each
run committed; here the two traces are compared value by value, bit for bit, in the order the loop produced
them, so the report names the first value that differs: which iteration, which field, which sample / token
or tensor, and both values. Nothing here imports Prefect, Ray or a model.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rollflow.tasks.debug.checks import FAIL, PASS, CheckResult
from rollflow.tasks.groups import identical_groups

REPRO = "bitwise_reproducibility"
DIVERSITY = "group_diversity"

REPRO_CAUSES = [
    "a nondeterministic op (atomics in a CUDA kernel, non-deterministic scatter / index_add, flash-attention "
    "backward): set torch.use_deterministic_algorithms and CUBLAS_WORKSPACE_CONFIG",
    "an unseeded random generator (sampling, dropout, data order) or a seed that depends on the process",
    "thread count or batch layout differs between the runs (train.threads, micro-batch split)",
    "state leaking between runs: a reused actor, a cache, or an artifact of an earlier run read back",
]
DIVERSITY_CAUSES = [
    "every sample of a group gets the same sampling seed (SGLang's native n copies one seed to all n)",
    "sampling is greedy despite temperature > 0: top_k=1, a greedy flag, or temperature not passed to the engine",
]


@dataclasses.dataclass
class IterationTrace:
    """What one iteration committed: the rollout's samples, the train records and metrics, the steps."""

    rollout_id: int
    tokens: list[list[int]]
    rewards: list[float | None]
    rollout_log_probs: list[list[float]]
    records: dict[str, list[float | None]]  # tasks/train/records.py columns (trainer log-probs, advantages)
    metrics: dict[str, Any]  # the metrics.jsonl row
    steps: list[dict[str, Any]]  # the train_steps.jsonl rows


@dataclasses.dataclass
class RunTrace:
    run: str
    iterations: list[IterationTrace]
    weights: dict[str, torch.Tensor]  # the final checkpoint's model tensors


@dataclasses.dataclass(frozen=True)
class Difference:
    iteration: int | None  # 1-based, as metrics.jsonl; None: the final weights
    field: str
    where: str
    a: Any
    b: Any

    def describe(self) -> str:
        at = "final weights" if self.iteration is None else f"iteration {self.iteration}"
        return f"{at}, {self.field}, {self.where}: {self.a!r} vs {self.b!r}"


# Recorded figures that are wall-clock or placement dependent, never part of the comparison.
VOLATILE_PREFIXES = ("perf/",)
VOLATILE_KEYS = frozenset({"rollout_uri"})


def same_bits(a: Any, b: Any) -> bool:
    """Floats by their bits (so -0.0 != 0.0 and a NaN equals the same NaN), everything else by ==."""
    if isinstance(a, float) or isinstance(b, float):
        if a is None or b is None or not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
            return False
        return struct.pack("<d", float(a)) == struct.pack("<d", float(b))
    return a == b


def _first_in_rows(
    field: str, a: Sequence[Sequence[Any]], b: Sequence[Sequence[Any]], unit: str
) -> tuple[str, str, Any, Any] | None:
    if len(a) != len(b):
        return f"{field} (samples)", "count", len(a), len(b)
    for i, (row_a, row_b) in enumerate(zip(a, b)):
        if len(row_a) != len(row_b):
            return field, f"sample {i} (length)", len(row_a), len(row_b)
        for j, (x, y) in enumerate(zip(row_a, row_b)):
            if not same_bits(x, y):
                return field, f"sample {i} {unit} {j}", x, y
    return None


def _first_in_values(
    field: str, a: Sequence[Any], b: Sequence[Any], label: str = "sample"
) -> tuple[str, str, Any, Any] | None:
    if len(a) != len(b):
        return field, "count", len(a), len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        if not same_bits(x, y):
            return field, f"{label} {i}", x, y
    return None


def _first_in_mapping(a: Mapping[str, Any], b: Mapping[str, Any], where: str) -> tuple[str, str, Any, Any] | None:
    for key in sorted(set(a) | set(b)):
        if key.startswith(VOLATILE_PREFIXES) or key in VOLATILE_KEYS:
            continue
        if key not in a or key not in b or not same_bits(a[key], b[key]):
            return key, where, a.get(key), b.get(key)
    return None


def first_difference_in_iteration(a: IterationTrace, b: IterationTrace) -> tuple[str, str, Any, Any] | None:
    """In the loop's order: what the engine generated, the rewards, the trainer's numbers, the steps."""
    checks = [
        lambda: _first_in_rows("token ids", a.tokens, b.tokens, "token"),
        lambda: _first_in_values("reward", a.rewards, b.rewards),
        lambda: _first_in_rows("rollout log-probs", a.rollout_log_probs, b.rollout_log_probs, "token"),
        *[
            (lambda name=name: _first_in_values(f"train {name}", a.records.get(name, []), b.records.get(name, [])))
            for name in sorted(set(a.records) | set(b.records))
        ],
        lambda: ("optimizer steps", "count", len(a.steps), len(b.steps)) if len(a.steps) != len(b.steps) else None,
        *[
            (lambda i=i: _first_in_mapping(a.steps[i], b.steps[i], f"step {i + 1}"))
            for i in range(min(len(a.steps), len(b.steps)))
        ],
        lambda: _first_in_mapping(a.metrics, b.metrics, "metrics.jsonl"),
    ]
    for check in checks:
        found = check()
        if found is not None:
            return found
    return None


def _tensor_value(t: torch.Tensor, index: int) -> float | int:
    return t.reshape(-1)[index].item()


def first_weight_difference(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> Difference | None:
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            return Difference(
                None, "tensor", name, "present" if name in a else "missing", "present" if name in b else "missing"
            )
        x, y = a[name], b[name]
        if x.dtype != y.dtype or x.shape != y.shape:
            return Difference(None, "tensor", name, f"{x.dtype}{tuple(x.shape)}", f"{y.dtype}{tuple(y.shape)}")
        # bits, not values: a NaN payload or a signed zero is a difference
        xb, yb = _as_bits(x), _as_bits(y)
        if not torch.equal(xb, yb):
            index = int((xb.reshape(-1) != yb.reshape(-1)).nonzero()[0])
            return Difference(
                None, "tensor", f"{name} element {index}", _tensor_value(x, index), _tensor_value(y, index)
            )
    return None


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    if not t.is_floating_point():
        return t
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])


def first_difference(a: RunTrace, b: RunTrace) -> Difference | None:
    if len(a.iterations) != len(b.iterations):
        return Difference(None, "iterations", "count", len(a.iterations), len(b.iterations))
    for it_a, it_b in zip(a.iterations, b.iterations):
        found = first_difference_in_iteration(it_a, it_b)
        if found is not None:
            return Difference(it_a.rollout_id + 1, *found)
    return first_weight_difference(a.weights, b.weights)


def _count(trace: RunTrace) -> int:
    per_iteration = sum(len(t) for it in trace.iterations for t in it.tokens)
    return per_iteration + sum(t.numel() for t in trace.weights.values())


def repro_check(a: RunTrace, b: RunTrace) -> CheckResult:
    diff = first_difference(a, b)
    figures = {
        "runs": [a.run, b.run],
        "iterations": len(a.iterations),
        "tensors": len(a.weights),
        "values_compared": _count(a),
    }
    if diff is None:
        return CheckResult(
            REPRO,
            PASS,
            figures,
            f"two runs of the same config are bitwise equal ({len(a.iterations)} "
            f"iterations: token ids, rewards, log-probs, losses, final weights)",
        )
    figures["first_difference"] = dataclasses.asdict(diff)
    return CheckResult(REPRO, FAIL, figures, f"first differing value: {diff.describe()}", list(REPRO_CAUSES))


@dataclasses.dataclass(frozen=True)
class IdenticalGroups:
    iteration: int
    groups: list[int]
    n_groups: int


def diversity_check(
    iterations: Sequence[IterationTrace], group_size: int, temperature: float, *, max_fraction: float = 0.5
) -> CheckResult:
    """Fails when temperature > 0 yet more than `max_fraction` of an iteration's prompt groups are groups of
    identical samples. Some identical groups are a confident policy (the demo's warm-started model answers
    short sums alike); most of them is sampling that ignores the temperature or reuses one seed per group."""
    figures: dict[str, Any] = {"temperature": temperature, "group_size": group_size, "max_fraction": max_fraction}
    if temperature <= 0 or group_size <= 1:
        why = "greedy sampling (temperature 0)" if temperature <= 0 else "one sample per prompt"
        return CheckResult(DIVERSITY, PASS, figures, f"not applicable: {why}")
    worst: IdenticalGroups | None = None
    for it in iterations:
        groups = identical_groups(it.tokens, group_size)
        found = IdenticalGroups(it.rollout_id + 1, groups, len(it.tokens) // group_size)
        if worst is None or len(groups) / max(found.n_groups, 1) > len(worst.groups) / max(worst.n_groups, 1):
            worst = found
    if worst is None:
        return CheckResult(DIVERSITY, PASS, figures, "no iterations to check")
    fraction = len(worst.groups) / max(worst.n_groups, 1)
    figures.update(
        iteration=worst.iteration,
        identical_groups=len(worst.groups),
        n_groups=worst.n_groups,
        fraction=fraction,
        first_groups=worst.groups[:10],
    )
    if fraction > max_fraction or (worst.n_groups and fraction == 1.0):
        return CheckResult(
            DIVERSITY,
            FAIL,
            figures,
            f"iteration {worst.iteration}: {len(worst.groups)} of {worst.n_groups} prompt groups have "
            f"{group_size} identical samples at temperature {temperature:g} (first groups "
            f"{worst.groups[:5]}): their advantages are all 0",
            list(DIVERSITY_CAUSES),
        )
    return CheckResult(
        DIVERSITY,
        PASS,
        figures,
        f"at most {fraction:.1%} of prompt groups are all-identical (iteration {worst.iteration})",
    )
