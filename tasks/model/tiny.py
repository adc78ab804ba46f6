"""The embedded default model: a tiny Qwen2-shaped causal LM built from a config (no download)."""

from __future__ import annotations

from pathlib import Path

import torch

from rollflow.tasks.model.source import check_model_dir
from rollflow.tasks.model.tokenizer import CharTokenizer

# Digits plus the operator characters of the synthetic task; small on purpose (ids 0-2 are special).
ADDITION_ALPHABET = "0123456789+="


def addition_tokenizer() -> CharTokenizer:
    """The demo's character tokenizer (the built-in models share it)."""
    return CharTokenizer(alphabet=ADDITION_ALPHABET, vocab_size=len(ADDITION_ALPHABET) + 3)


def tiny_shape(vocab_size: int, *, hidden: int, layers: int, heads: int, max_positions: int) -> dict:
    """The config fields every built-in tiny model shares (its dense and MoE variants differ only in the FFN)."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        # SDPA everywhere: the rollout and the trainer then share one attention kernel family.
        attn_implementation="sdpa",
    )


def seeded_model(model_cls, config, seed: int):
    """`model_cls(config)` with its random init drawn after `torch.manual_seed(seed)`."""
    torch.manual_seed(seed)
    return model_cls(config)


def tiny_qwen2_config(vocab_size: int, *, hidden: int = 128, layers: int = 2, heads: int = 4, max_positions: int = 64):
    from transformers import Qwen2Config

    return Qwen2Config(**tiny_shape(vocab_size, hidden=hidden, layers=layers, heads=heads, max_positions=max_positions))


def build_tiny_model(seed: int = 0, **config_overrides):
    from transformers import Qwen2ForCausalLM

    tokenizer = addition_tokenizer()
    return seeded_model(Qwen2ForCausalLM, tiny_qwen2_config(tokenizer.vocab_size, **config_overrides), seed), tokenizer


def load_model(model_dir: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Load a causal LM from a local HF-format directory (no hub access), in `dtype` on `device`.

    The directory is checked first (config.json of a Llama / Qwen2 / Qwen3 model, safetensors
    weights): an incomplete directory fails naming the missing file, see `check_model_dir`.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per actor per load clutters the run's terminal
    model_dir = Path(model_dir)
    check_model_dir(model_dir, tokenizer=False)
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), local_files_only=True, dtype=dtype, attn_implementation="sdpa"
    )
    return model.to(device)
