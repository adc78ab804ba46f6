"""The built-in tiny MoE model (`builtin:addition-moe`): a 2-layer Qwen3-MoE built from a config.

It exists for the CPU tests of the MoE paths (hf engine, torch trainer, weight sync, routing replay):
the demo's character tokenizer, 8 experts per layer, top-2 routing. Its weights are a seeded random
init (it is not warm-started: MoE numerics, not addition, are what it tests), written once by
`write_tiny_moe` into the package so a run never builds or downloads anything.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rollflow.tasks.model.tiny import ADDITION_ALPHABET
from rollflow.tasks.model.tokenizer import CharTokenizer

MOE_EXPERTS = 8
MOE_TOP_K = 2


def tiny_moe_config(vocab_size: int, *, hidden: int = 128, layers: int = 2, heads: int = 4, max_positions: int = 64):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        moe_intermediate_size=hidden // 2,
        num_experts=MOE_EXPERTS,
        num_experts_per_tok=MOE_TOP_K,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="sdpa",
    )


def build_tiny_moe(seed: int = 0, **config_overrides):
    from transformers import Qwen3MoeForCausalLM

    tokenizer = CharTokenizer(alphabet=ADDITION_ALPHABET, vocab_size=len(ADDITION_ALPHABET) + 3)
    config = tiny_moe_config(tokenizer.vocab_size, **config_overrides)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    return model, tokenizer


def write_tiny_moe(out: str | Path, seed: int = 0) -> Path:
    """Save the seeded tiny MoE (safetensors + tokenizer) to `out`: how `builtin/addition-moe` was made."""
    out = Path(out)
    model, tokenizer = build_tiny_moe(seed)
    model.save_pretrained(out)
    tokenizer.save(out)
    return out
