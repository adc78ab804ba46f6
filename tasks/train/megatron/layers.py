"""Layer specs of the megatron backend (`MegatronSettings.layer_spec`) and the torch norms they build.

- "te": Transformer Engine spec (fused layernorm-linear, TE attention). Needs transformer-engine.
- "local": megatron-core's own modules; its core attention is unfused (scores materialised).
- "sdpa": the local spec with core attention replaced by `SDPACoreAttention` (attention.py: torch's
  scaled_dot_product_attention: flash / cuDNN / memory-efficient kernels), Megatron's documented
  extension point (a layer spec's `core_attention` submodule). Flash attention without TE.
- "auto": "te" when transformer_engine imports, else "sdpa".
"""

from __future__ import annotations

import torch

from rollflow.tasks.train.megatron.attention import make_sdpa_core_attention
from rollflow.tasks.train.megatron.process import have_transformer_engine
from rollflow.tasks.train.settings import MegatronSettings


def resolve_layer_spec(name: str) -> str:
    if name == "auto":
        return "te" if have_transformer_engine() else "sdpa"
    if name == "te" and not have_transformer_engine():
        raise ImportError(
            "train.megatron.layer_spec='te' needs transformer-engine (pip install 'rollflow[te]'); "
            "use 'sdpa' (torch SDPA core attention) or 'local'"
        )
    return name


def build_layer_spec(spec: str, settings: MegatronSettings, *, qk_layernorm: bool = False):
    from megatron.core.models.gpt import gpt_layer_specs as specs  # optional dependency: imported on use

    if spec == "te":
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    # a fresh spec object per call
    layer = specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm)
    if spec == "sdpa":
        layer.submodules.self_attention.submodules.core_attention = make_sdpa_core_attention(settings.sdpa_backends)
    elif spec != "local":
        raise ValueError(f"train.megatron.layer_spec={spec!r}: expected auto, te, sdpa or local")
    # torch norms that allow sequence parallelism (megatron-core's refuse it)
    layer.submodules.input_layernorm = SequenceParallelRMSNorm
    layer.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    attention = layer.submodules.self_attention.submodules
    if qk_layernorm:
        attention.q_layernorm = attention.k_layernorm = HeadRMSNorm
    return layer


def build_block_spec(
    spec: str, settings: MegatronSettings, config, *, qk_layernorm: bool = False, vp_stage: int | None = None
):
    """The layer spec, or for the torch specs the whole block's (its layers and the final norm: Megatron
    would build that one with its own torch norm, which refuses sequence parallelism)."""
    layer = build_layer_spec(spec, settings, qk_layernorm=qk_layernorm)
    if spec == "te":
        return layer
    # optional dependency: imported on use
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    count = get_num_layers_to_build(
        config, vp_stage=vp_stage, pp_rank=parallel_state.get_pipeline_model_parallel_rank()
    )
    return TransformerBlockSubmodules(layer_specs=[layer] * count, layer_norm=SequenceParallelRMSNorm)


class SequenceParallelRMSNorm:
    """torch's RMSNorm for the hidden states (what megatron-core's WrappedTorchNorm builds), tagged
    `sequence_parallel` as Megatron's own norms tag theirs: under sequence parallelism each TP rank normalises
    its part of the sequence, and `finalize_model_grads` sums the norm weights' grads over TP by that tag.
    A class whose construction returns the module: Megatron's build_module calls classes, not functions."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused) -> torch.nn.Module:
        norm = HeadRMSNorm(config, hidden_size, eps)
        norm.weight.sequence_parallel = bool(config.sequence_parallel)
        return norm


class HeadRMSNorm:
    """The q / k norms (per head): they see the whole sequence, so no sequence-parallel tag (Megatron sums
    their grads over TP by `qk_layernorm` instead: each rank's copy sees its own heads)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused) -> torch.nn.Module:
        if config.normalization != "RMSNorm":
            raise ValueError(f"normalization={config.normalization!r}: the torch layer specs build RMSNorm only")
        return torch.nn.RMSNorm(hidden_size, eps=eps)
