"""Inputs of replay training: pinned rollouts, whole-group subsampling."""

from __future__ import annotations

from collections import Counter

from rollflow.artifacts.columns import SampleColumns
from rollflow.artifacts.sample import Sample


def _group_indices(samples: list[Sample] | SampleColumns) -> list[int]:
    """Each row's group_index: from `Sample`s, or one column of `SampleColumns` (no Sample built)."""
    if isinstance(samples, SampleColumns):
        return samples.numpy("group_index").tolist()
    return [s.group_index for s in samples]


def infer_group_size(samples: list[Sample] | SampleColumns) -> int:
    """Samples per prompt group; every group must have the same size and be contiguous."""
    if not len(samples):
        raise ValueError("rollout has no samples")
    order = _group_indices(samples)
    sizes = Counter(order)
    distinct = set(sizes.values())
    if len(distinct) != 1:
        raise ValueError(f"prompt groups have different sizes {sorted(distinct)}: group advantages need equal groups")
    if any(a != b and b in order[:i] for i, (a, b) in enumerate(zip(order, order[1:]), start=1)):
        raise ValueError("samples of a prompt group are not contiguous; sort the rollout by group_index")
    return distinct.pop()


def subsample_groups(
    samples: list[Sample] | SampleColumns, ratio: float, group_size: int
) -> list[Sample] | SampleColumns:
    """Keep `ratio` of the prompt groups: the first and the last halves (as slime), whole groups only.

    Whole groups keep group-normalised advantages correct; a ratio that keeps nothing is an error
    (slime returns everything in that case, which hides the mistake).
    """
    if not 0 < ratio <= 1:
        raise ValueError(f"debug.load_debug_rollout_data_subsample={ratio} must be in (0, 1]")
    n_groups = len(samples) // group_size
    keep = int(n_groups * ratio)
    if keep == 0:
        raise ValueError(
            f"debug.load_debug_rollout_data_subsample={ratio} keeps 0 of {n_groups} prompt groups; "
            f"use a ratio >= {1 / n_groups:.4g}"
        )
    head = (keep + 1) // 2
    tail = keep - head
    if isinstance(samples, SampleColumns):  # the same rows, one take
        chosen_groups = list(range(head)) + list(range(n_groups - tail, n_groups) if tail else [])
        return samples.take([g * group_size + k for g in chosen_groups for k in range(group_size)])
    groups = [samples[i * group_size : (i + 1) * group_size] for i in range(n_groups)]
    chosen = groups[:head] + (groups[n_groups - tail :] if tail else [])
    return [s for group in chosen for s in group]
