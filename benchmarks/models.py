"""Benchmark models built from a config (random weights, nothing downloaded) and synthetic inputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

# Qwen2 shapes. `qwen2-0.5b` is Qwen2-0.5B's architecture (docs/performance.md measures it on the H200).
SHAPES: dict[str, dict[str, Any]] = {
    "cpu-tiny": dict(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=512,
    ),
    "cpu-small": dict(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=4096,
    ),
    "cpu-sync": dict(
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=32000,
    ),
    "qwen2-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        rope_theta=1_000_000.0,
    ),
    "qwen2-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        rope_theta=1_000_000.0,
    ),
    "qwen2.5-3b": dict(
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        vocab_size=151936,
        rope_theta=1_000_000.0,
    ),
    # Qwen2.5-7B's shape (tied embeddings here, so ~7.07B parameters; the released model has a separate LM head):
    # for the 7B weight-sync figure, where engine and trainer hold only the weights.
    "qwen2.5-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        rope_theta=1_000_000.0,
    ),
    # Qwen2.5-7B's layers, 20 of its 28, tied embeddings (qwen2() ties them): ~5.2B parameters, sized so the
    # trainer's full state (~18 bytes per parameter with Megatron's optimizer) leaves the engine room on one H200.
    "qwen2.5-7b-20l": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=20,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        rope_theta=1_000_000.0,
    ),
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def random_init(
    config_cls, model_cls, fields: dict[str, Any], *, dtype: str, device: str, seed: int, max_positions: int
):
    """A random-init transformers model of `fields` (its config's shape), built on `device`: tied embeddings, ids
    0-2 for pad / bos / eos, sdpa attention, in eval mode."""
    config = config_cls(
        **fields,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(config)
    return model.to(dtype=DTYPES[dtype]).eval()


def qwen2(shape: str, *, dtype: str = "float32", device: str = "cpu", seed: int = 0, max_positions: int = 4096):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return random_init(
        Qwen2Config, Qwen2ForCausalLM, SHAPES[shape], dtype=dtype, device=device, seed=seed, max_positions=max_positions
    )


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def matmul_params(model) -> int:
    """Parameters used in matrix multiplies per token (linear layers incl. the LM head; no embedding lookup)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def state_bytes(named: dict[str, torch.Tensor]) -> int:
    """Bytes of distinct storage: a tied tensor (Qwen2-0.5B's embedding = lm_head) counts once."""
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in named.values()}
    return sum(unique.values())


def random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # ids 0-2 are pad / bos / eos: prompts never contain them
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


def synthetic_samples(n: int, prompt_len: int, response_len: int, vocab: int, *, group: int = 4, seed: int = 0):
    """Samples shaped like a rollout (full-length responses, 0/1 rewards), without generating them."""
    from rollflow.artifacts.sample import Sample, Status

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, vocab, (n, prompt_len + response_len), generator=g).tolist()
    logps = (-torch.rand((n, response_len), generator=g) * 4).tolist()
    rewards = (torch.rand(n, generator=g) > 0.5).tolist()
    return [
        Sample(
            group_index=i // group,
            index=i,
            prompt=f"prompt {i // group}",
            tokens=tokens[i],
            response="",
            response_length=response_len,
            loss_mask=[1] * response_len,
            rollout_log_probs=logps[i],
            reward=float(rewards[i]),
            status=Status.TRUNCATED,
        )
        for i in range(n)
    ]


def save_model_dir(model, directory: Path) -> Path:
    """A local HF model directory the rollflow workers load (weights + the built-in char tokenizer)."""
    from rollflow.tasks.model.source import resolve_model_path
    from rollflow.tasks.model.tokenizer import CHAR_TOKENIZER_FILE

    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    shutil.copy(resolve_model_path("builtin:addition") / CHAR_TOKENIZER_FILE, directory / CHAR_TOKENIZER_FILE)
    return directory


def describe(shape: str) -> str:
    return json.dumps(SHAPES[shape], sort_keys=True)
