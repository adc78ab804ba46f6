"""Partial rollouts (slime's partial rollout, AReaL's interruptible generation): samples aborted at a
weight sync keep their tokens and log-probs and are continued in the next rollout under the new weights.

An aborted group is stored in its rollout's artifact marked `filtered = aborted` (not trained there);
the next rollout reads it back from that artifact (so a resumed run continues exactly what was
committed), continues its aborted samples and trains on the whole group. Each continued token's
weight version is recorded (`metadata.weight_versions`).
"""

from __future__ import annotations

import dataclasses

from rollflow.artifacts.pipeline_meta import (
    CONTINUED_FROM,
    FILTERED,
    WAITED,
    WEIGHT_VERSIONS,
    filtered_reason,
    mark_filtered,
    oldest_weight_version,
    token_weight_versions,
)
from rollflow.artifacts.sample import Sample, Status
from rollflow.tasks.model.tokenizer import Tokenizer, decode_response
from rollflow.tasks.rollout.engine import GenerationRequest, RolloutEngine, SamplingParams
from rollflow.tasks.rollout.generate import FINISH_TO_STATUS


def aborted_groups(samples: list[Sample]) -> list[list[Sample]]:
    """The groups of a committed rollout that were deferred (marked `aborted`), each in sample order."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        if filtered_reason(s) == "aborted":
            groups.setdefault(s.group_index, []).append(s)
    return [groups[g] for g in sorted(groups)]


def defer_aborted(samples: list[Sample], group_size: int) -> list[Sample]:
    """Mark every group with an aborted sample `aborted` (continued next rollout, not trained now)."""
    out: list[Sample] = []
    for start in range(0, len(samples), group_size):
        group = samples[start : start + group_size]
        if any(Status.parse(s.status) is Status.ABORTED for s in group) and not any(filtered_reason(s) for s in group):
            group = mark_filtered(group, "aborted")
        out.extend(group)
    return out


def too_old_to_continue(samples: list[Sample], next_trainer_version: int, max_staleness: int) -> set[int]:
    """Group indices of the deferred (`aborted`) groups of `samples` whose oldest token would be more than
    `max_staleness` versions behind the trainer of the next rollout, where they would be continued: under
    pipeline.stale_policy=wait they are finished now, before the weights change; under drop the next rollout
    marks them `stale` (`continue_groups`)."""
    return {
        group[0].group_index
        for group in aborted_groups(samples)
        if next_trainer_version - min(oldest_weight_version(s) for s in group) > max_staleness
    }


def mark_waited(samples: list[Sample]) -> list[Sample]:
    """Copies of `samples` (finished groups) recorded as finished before the sync (`waited_at_sync`)."""
    return [dataclasses.replace(s, metadata={**s.metadata, WAITED: True}) for s in samples]


def _unmarked(sample: Sample) -> Sample:
    meta = {k: v for k, v in sample.metadata.items() if k != FILTERED}
    return dataclasses.replace(sample, metadata=meta)


def continue_groups(
    engine: RolloutEngine,
    tokenizer: Tokenizer,
    groups: list[list[Sample]],
    params: SamplingParams,
    *,
    source_rollout_id: int,
    trainer_version: int,
    max_staleness: int,
) -> list[list[Sample]]:
    """`groups` with their aborted samples continued by `engine` (its current weights), completed samples kept.

    A group whose oldest token would be more than `max_staleness` versions behind `trainer_version` (the
    trainer that will train this rollout) is not continued: it comes back marked `stale`."""
    out: list[list[Sample]] = []
    todo: list[tuple[int, int, Sample]] = []  # (group, position, aborted sample)
    for g, group in enumerate(groups):
        oldest = min(oldest_weight_version(s) for s in group)
        if trainer_version - oldest > max_staleness:
            out.append(mark_filtered([_unmarked(s) for s in group], "stale"))
            continue
        out.append([_unmarked(s) for s in group])
        todo.extend((g, i, s) for i, s in enumerate(group) if Status.parse(s.status) is Status.ABORTED)
    # One generate call per remaining budget (the engine takes one max_new_tokens per call).
    by_budget: dict[int, list[tuple[int, int, Sample]]] = {}
    for item in todo:
        budget = params.max_new_tokens - item[2].response_length
        by_budget.setdefault(budget, []).append(item)
    for budget, items in sorted(by_budget.items()):
        if budget < 1:  # nothing left to generate: the sample is as long as it may get
            for g, i, _s in items:
                out[g][i] = dataclasses.replace(out[g][i], status=Status.TRUNCATED)
            continue
        requests = [GenerationRequest(prompt_ids=list(s.tokens), n=1) for _, _, s in items]
        outputs = engine.generate(requests, dataclasses.replace(params, max_new_tokens=budget))
        for (g, i, _s), (result,) in zip(items, outputs):
            out[g][i] = _extended(
                out[g][i],
                result.response_ids,
                result.log_probs,
                result.finish_reason,
                engine.weight_version,
                tokenizer,
                source_rollout_id,
            )
            if result.routes is not None:
                # Routing replay: the continuing engine routed the whole prefix again (its prefill) and the new
                # tokens; its routes replace the cut sample's, as slime assigns SGLang's for the whole sequence.
                out[g][i] = dataclasses.replace(out[g][i], routed_experts=result.routes.tolist())
    return out


def _extended(
    sample: Sample,
    new_ids: list[int],
    new_log_probs: list[float],
    finish: str,
    version: int,
    tokenizer: Tokenizer,
    source_rollout_id: int,
) -> Sample:
    versions = token_weight_versions(sample) + [int(version)] * len(new_ids)
    response_ids = sample.response_tokens + list(new_ids)
    meta = dict(sample.metadata)
    meta[WEIGHT_VERSIONS] = versions
    meta.setdefault(CONTINUED_FROM, {"rollout_id": source_rollout_id, "index": sample.index})
    return dataclasses.replace(
        sample,
        tokens=list(sample.tokens) + list(new_ids),
        response=decode_response(tokenizer, response_ids),
        response_length=len(response_ids),
        loss_mask=list(sample.loss_mask) + [1] * len(new_ids),
        rollout_log_probs=list(sample.rollout_log_probs) + list(new_log_probs),
        status=FINISH_TO_STATUS.get(finish, Status.FAILED),
        weight_version=int(version),
        reward=None,
        metadata=meta,
    )


def renumber(groups: list[list[Sample]], first_group: int = 0) -> list[Sample]:
    """Flat samples with consecutive group indices from `first_group` (continued groups keep their old
    numbers until placed in a rollout)."""
    out: list[Sample] = []
    for g, group in enumerate(groups):
        out.extend(dataclasses.replace(s, group_index=first_group + g) for s in group)
    return out
