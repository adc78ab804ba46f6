"""Turn prompts into `Sample`s through any `RolloutEngine`."""

from __future__ import annotations

import logging

from rollflow.artifacts.sample import Sample, Status
from rollflow.tasks.groups import identical_groups, identical_groups_warning
from rollflow.tasks.model.tokenizer import Tokenizer, decode_response, prompt_token_ids
from rollflow.tasks.rollout.engine import GenerationRequest, RolloutEngine, SamplingParams
from rollflow.tasks.rollout.prompts import PromptItem

logger = logging.getLogger(__name__)

FINISH_TO_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


def build_requests(items: list[PromptItem], tokenizer: Tokenizer, n_samples_per_prompt: int) -> list[GenerationRequest]:
    """Prompt token ids with special tokens added once (chat template, or the tokenizer's own rule)."""
    return [
        GenerationRequest(prompt_ids=prompt_token_ids(tokenizer, it.prompt), n=n_samples_per_prompt) for it in items
    ]


def generate_samples(
    engine: RolloutEngine,
    tokenizer: Tokenizer,
    items: list[PromptItem],
    params: SamplingParams,
    n_samples_per_prompt: int,
) -> list[Sample]:
    """Samples ordered by group (one group per prompt), `n_samples_per_prompt` each."""
    requests = build_requests(items, tokenizer, n_samples_per_prompt)
    outputs = engine.generate(requests, params)
    samples: list[Sample] = []
    for group_index, (item, req, outs) in enumerate(zip(items, requests, outputs)):
        for out in outs:
            status = FINISH_TO_STATUS.get(out.finish_reason, Status.FAILED)
            samples.append(
                Sample(
                    group_index=group_index,
                    index=len(samples),
                    prompt=item.prompt,
                    tokens=list(req.prompt_ids) + list(out.response_ids),
                    response=decode_response(tokenizer, out.response_ids),
                    response_length=len(out.response_ids),
                    loss_mask=[1] * len(out.response_ids),
                    rollout_log_probs=list(out.log_probs),
                    label=item.label,
                    status=status,
                    weight_version=engine.weight_version,
                    metadata=dict(item.metadata),
                    routed_experts=None if out.routes is None else out.routes.tolist(),
                )
            )
    warn_identical_groups(samples, n_samples_per_prompt, params)
    return samples


def warn_identical_groups(samples: list[Sample], n_samples_per_prompt: int, params: SamplingParams) -> int:
    """Log a warning when sampling produced groups of identical samples; returns their number.

    Greedy decoding makes identical groups on purpose (eval), so only sampled rollouts are checked."""
    if params.temperature == 0 or n_samples_per_prompt < 2:
        return 0
    found = identical_groups([s.tokens for s in samples], n_samples_per_prompt)
    if found:
        logger.warning(identical_groups_warning(len(found), len(samples) // n_samples_per_prompt, n_samples_per_prompt))
    return len(found)
