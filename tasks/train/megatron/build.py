"""This rank's megatron-core GPTModel for an HF Llama / Qwen2 / Qwen3 config: the TransformerConfig (RoPE,
parallel layout, fusions), the model chunk, and the tensor-parallel tags Megatron's initialisers would set.

Kernels (`fusions`, `rope_fusion`; "auto" = torch.compile'd on CUDA, eager on CPU): Megatron's bias-SwiGLU /
bias-dropout-add fusions and a compiled RoPE plugged into Megatron's `apply_rope_fusion` hook (fused_ops.py).
"""

from __future__ import annotations

from typing import Any

import torch

from rollflow.tasks.sync import megatron_names as mn
from rollflow.tasks.train.megatron.fused_ops import install_rope_fusion
from rollflow.tasks.train.megatron.layers import build_block_spec, resolve_layer_spec
from rollflow.tasks.train.settings import MegatronSettings


def _rope(hf_config) -> dict[str, Any]:
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"rotary_base": mn._rope_theta(hf_config)}
    if rope_type in (None, "default"):
        return out
    if rope_type == "llama3":
        if (
            params.get("low_freq_factor", 1.0),
            params.get("high_freq_factor", 4.0),
            params.get("original_max_position_embeddings", 8192),
        ) != (1.0, 4.0, 8192):
            raise NotImplementedError(f"llama3 rope scaling with non-default parameters {params} is not mapped")
        out.update(rope_scaling=True, rope_scaling_factor=float(params.get("factor", 8.0)))
        return out
    raise NotImplementedError(f"rope_type={rope_type!r} is not mapped to Megatron (default and llama3 are)")


def build_transformer_config(
    hf_config, settings: MegatronSettings, *, dtype: torch.dtype, device: torch.device, random_init: bool
):
    # optional dependency: imported on use
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    layout = mn.MegatronLayout.from_hf_config(hf_config)
    spec = resolve_layer_spec(settings.layer_spec)
    rope_fusion = settings.rope_fusion == "compiled"
    if rope_fusion:
        install_rope_fusion()  # before TransformerConfig: it checks that a fused RoPE is available
    kwargs: dict[str, Any] = dict(
        num_layers=layout.num_layers,
        hidden_size=layout.hidden_size,
        num_attention_heads=layout.num_attention_heads,
        num_query_groups=layout.num_query_groups,
        kv_channels=layout.head_dim,
        ffn_hidden_size=layout.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=float(getattr(hf_config, "rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=layout.qkv_bias,
        # In the config too, not only in the layer spec: finalize_model_grads sums the q/k norm grads over TP
        # only when it is set (each TP rank's copy sees its own heads); without it the replicas diverge.
        qk_layernorm=layout.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=dtype == torch.bfloat16,
        fp16=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=settings.tp,
        pipeline_model_parallel_size=settings.pp,
        virtual_pipeline_model_parallel_size=settings.vpp,
        context_parallel_size=settings.cp,
        sequence_parallel=settings.sequence_parallel,
        recompute_granularity=settings.recompute_granularity,
        recompute_method=settings.recompute_method,
        recompute_num_layers=settings.recompute_num_layers,
        use_cpu_initialization=device.type != "cuda",
        perform_initialization=random_init,
        # Fusions that need TE or apex stay off; the torch.compile'd ones are opt-in (settings.fusions).
        gradient_accumulation_fusion=False,
        apply_rope_fusion=rope_fusion,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_activation_fusion=settings.fusions == "on",
        bias_dropout_fusion=settings.fusions == "on",
        attention_softmax_in_fp32=True,
        attention_backend=AttnBackend[settings.attention_backend] if spec == "te" else AttnBackend.local,
    )
    if settings.vpp is not None:
        # Interleaved stages exchange activations and gradients with their neighbours at once. Batched into one
        # p2p call, the sends and receives between the same two ranks (pp = 2: next == previous) pair up in the
        # wrong order (the CPU test measured a 10x grad norm on gloo); overlap_p2p_comm posts them separately.
        kwargs.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    kwargs.update(settings.transformer_config)
    return TransformerConfig(**kwargs), spec


def build_gpt_model(
    hf_config,
    settings: MegatronSettings,
    *,
    dtype: torch.dtype,
    device: torch.device,
    random_init: bool = False,
    vp_stage: int | None = None,
):
    """This rank's megatron-core GPTModel (its TP shard of its pipeline stage; with vpp, of its virtual stage
    `vp_stage`) for an HF Llama / Qwen2 / Qwen3 config; returns (model, layout, spec). The layout's pipeline
    stages are the virtual ones (pp * vpp, `virtual_stage`). Parallel state must be initialised."""
    # optional dependency: imported on use
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    settings.check_model(
        hf_config.num_hidden_layers, getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    )
    config, spec = build_transformer_config(hf_config, settings, dtype=dtype, device=device, random_init=random_init)
    if spec == "local" and settings.cp > 1:
        raise ValueError(
            "train.megatron.cp > 1 needs layer_spec 'sdpa' or 'te': Megatron's local attention refuses "
            "context parallelism"
        )
    layout = mn.MegatronLayout.from_hf_config(
        hf_config,
        spec="te" if spec == "te" else "local",
        tp_size=settings.tp,
        pp_size=settings.pp * (settings.vpp or 1),
        make_vocab_size_divisible_by=settings.make_vocab_size_divisible_by,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=build_block_spec(
            spec, settings, config, qk_layernorm=layout.qk_layernorm, vp_stage=vp_stage
        ),
        vocab_size=layout.padded_vocab_size,
        max_sequence_length=int(getattr(hf_config, "max_position_embeddings", 4096)),
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        **({} if vp_stage is None else {"vp_stage": vp_stage}),
        parallel_output=True,
        share_embeddings_and_output_weights=layout.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        **_rope(hf_config),
    )
    # Norm weights are created in fp32; cast everything, as Megatron's Float16Module does (rotary inv_freq is a
    # plain attribute, not a buffer, so it stays fp32).
    model = model.to(device=device, dtype=dtype)
    mark_tensor_parallel(model, layout)
    return model, layout, spec


def mark_tensor_parallel(model: torch.nn.Module, layout: mn.MegatronLayout) -> None:
    """Tag every TP-split parameter as Megatron's parallel layers do when they initialise weights.

    megatron-core sets `tensor_model_parallel` / `partition_dim` only inside its weight initialisers, so with
    `perform_initialization=False` (weights loaded from HF) every parameter looks replicated: the global grad
    norm then counts TP rank 0's shards only (measured: 1.505 instead of 1.850 at tp=2) and clipping is wrong.
    """
    dims = {"column": 0, "vocab": 0, "fc1": 0, "row": 1}
    for name, param in model.named_parameters():
        dim = dims.get(mn.tp_rule(name, layout))
        if dim is not None:  # the attribute names of megatron.core.tensor_parallel.set_tensor_model_parallel_attributes
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, 1
