"""The engine's half of the post-sync probe (tasks/sync/probe.py): fixed prompts, a short seeded continuation.

The probe goes through the engine's ordinary `generate`, the path rollouts take, so whatever the engine serves
from (caches, graphs, compiled steps, the model object generation runs) is what gets scored.
"""

from __future__ import annotations

from rollflow.artifacts.sample import Sample
from rollflow.tasks.model.tokenizer import Tokenizer, has_chat_template
from rollflow.tasks.rollout.engine import RolloutEngine, SamplingParams
from rollflow.tasks.rollout.generate import generate_samples
from rollflow.tasks.rollout.prompts import PromptItem
from rollflow.tasks.rollout.settings import DataConfig, RolloutConfig, prompts_for
from rollflow.tasks.sync.probe import ProbeSpec

# Fixed prompts for runs whose data only their rollout function can render.
PLAIN_PROMPTS = ("12+34=", "507+219=", "0+0=", "999+1=")  # digits: any tokenizer, the char one too


def probe_params(rollout: RolloutConfig, spec: ProbeSpec, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
    """The rollout's temperature (the trainer scores at it; 0 = greedy, scored at 1 by both), full softmax."""
    return SamplingParams(
        temperature=rollout.temperature,
        top_p=1.0,
        top_k=0,
        max_new_tokens=min(spec.tokens, rollout.max_new_tokens),
        stop_token_ids=stop_token_ids,
        seed=spec.seed,
    )


def probe_samples(
    engine: RolloutEngine,
    tokenizer: Tokenizer,
    data: DataConfig,
    rollout: RolloutConfig,
    spec: ProbeSpec,
    stop_token_ids: tuple[int, ...] = (),
) -> list[Sample]:
    """One sample per probe prompt, with the engine's log-probs as `rollout_log_probs`."""
    if data.apply_chat_template and not has_chat_template(tokenizer):
        # Only the run's own rollout function renders these prompts (chat messages, no chat template): the probe
        # needs fixed token sequences, not the task's prompts.
        items = [PromptItem(prompt=text, label=None) for text in PLAIN_PROMPTS[: spec.prompts]]
    else:
        items = prompts_for(data, 0, "train")[: spec.prompts]
    return generate_samples(engine, tokenizer, items, probe_params(rollout, spec, stop_token_ids), 1)
