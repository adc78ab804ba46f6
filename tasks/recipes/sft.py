"""Supervised warm-start of the tiny default model on the addition task.

A whole-model recipe (it trains the model and measures it by generating), so it sits above both
tasks/rollout and tasks/train (rollflow.tasks.recipes), not inside either.

RL needs a policy that is sometimes right: learning here is a sharp phase transition, so training
stops on held-out greedy accuracy, not after a fixed time (docs/architecture.md section 10, "The demo recipe").
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from rollflow.tasks.model.tiny import build_tiny_model
from rollflow.tasks.model.tokenizer import CharTokenizer
from rollflow.tasks.rollout.addition import addition_prompts, addition_reward
from rollflow.tasks.rollout.engine import SamplingParams
from rollflow.tasks.rollout.generate import generate_samples
from rollflow.tasks.rollout.hf_engine import HFEngine
from rollflow.tasks.rollout.prompts import PromptItem


@dataclasses.dataclass(frozen=True)
class SFTResult:
    steps: int
    seconds: float
    accuracy: float


def encode_pair(tok: CharTokenizer, item: PromptItem) -> tuple[list[int], int]:
    prompt = [tok.bos_token_id] + tok.encode(item.prompt)
    return prompt + tok.encode(item.label) + [tok.eos_token_id], len(prompt)


def greedy_accuracy(model, tok: CharTokenizer, items: list[PromptItem]) -> float:
    engine = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    params = SamplingParams(temperature=0.0, max_new_tokens=len(items[0].label) + 1)
    samples = generate_samples(engine, tok, items, params, 1)
    model.train()
    return sum(addition_reward(s.response, s.label or "") for s in samples) / len(samples)


def warm_start(
    out_dir: str | Path,
    *,
    target_accuracy: float = 0.30,
    seed: int = 0,
    batch_size: int = 128,
    lr: float = 1e-3,
    max_steps: int = 20000,
    eval_every: int = 100,
    digits: int = 3,
    log=print,
) -> SFTResult:
    torch.manual_seed(seed)
    model, tok = build_tiny_model(seed=seed)
    model.train()
    held_out = addition_prompts(256, seed=seed + 999_999, digits=digits)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    started, accuracy, step = time.perf_counter(), 0.0, 0
    for step in range(1, max_steps + 1):
        items = addition_prompts(batch_size, seed=seed * 7919 + step, digits=digits)
        pairs = [encode_pair(tok, it) for it in items]
        ids = torch.tensor([p for p, _ in pairs])
        labels = ids.clone()
        for row, (_, prompt_len) in enumerate(pairs):
            labels[row, :prompt_len] = -100  # learn the answer, not the question
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % eval_every == 0:
            accuracy = greedy_accuracy(model, tok, held_out)
            log(f"sft step {step}: loss {loss.item():.4f}, held-out greedy accuracy {accuracy:.3f}")
            if accuracy >= target_accuracy:
                break
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save(out)
    return SFTResult(steps=step, seconds=time.perf_counter() - started, accuracy=accuracy)
