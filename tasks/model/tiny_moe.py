"""The built-in tiny MoE model (`builtin:addition-moe`): a 2-layer Qwen3-MoE built from a config.

It exists for the CPU tests of the MoE paths (hf engine, torch trainer, weight sync, routing replay):
the demo's character tokenizer, 8 experts per layer, top-2 routing. Its weights are a seeded random
init (it is not warm-started: MoE numerics, not addition, are what it tests), written once by
`write_tiny_moe` into the package so a run never builds or downloads anything.
"""

from __future__ import annotations

from pathlib import Path

from rollflow.tasks.model.tiny import addition_tokenizer, seeded_model, tiny_shape

MOE_EXPERTS = 8
MOE_TOP_K = 2


def tiny_moe_config(vocab_size: int, *, hidden: int = 128, layers: int = 2, heads: int = 4, max_positions: int = 64):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **tiny_shape(vocab_size, hidden=hidden, layers=layers, heads=heads, max_positions=max_positions),
        moe_intermediate_size=hidden // 2,
        num_experts=MOE_EXPERTS,
        num_experts_per_tok=MOE_TOP_K,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        head_dim=hidden // heads,
    )


def build_tiny_moe(seed: int = 0, **config_overrides):
    from transformers import Qwen3MoeForCausalLM

    tokenizer = addition_tokenizer()
    return seeded_model(Qwen3MoeForCausalLM, tiny_moe_config(tokenizer.vocab_size, **config_overrides), seed), tokenizer


def write_tiny_moe(out: str | Path, seed: int = 0) -> Path:
    """Save the seeded tiny MoE (safetensors + tokenizer) to `out`: how `builtin/addition-moe` was made."""
    out = Path(out)
    model, tokenizer = build_tiny_moe(seed)
    model.save_pretrained(out)
    tokenizer.save(out)
    return out
