"""The `megatron` TrainBackend: a megatron-core GPTModel for the Llama / Qwen2 / Qwen3 family, one rank of a
TP x PP x DP layout (docs/megatron.md, "Parallel training").

Behind the same protocol as `torch_backend.TorchBackend` (tasks/train/step.py: TrainBackend): the same
TrainBatch layout, the same `micro_batch_objective`, the same `train/*` metric names. Weights come in
and go out with HF names through `rollflow.tasks.sync.megatron_names`, so the engine sync and the parity check
(`rollflow.tasks.sync.parity.compare`) are unchanged.

megatron-core is imported lazily: this module imports on a CPU box without it, and building the backend
there raises `MegatronMissing` with the install line.

Layer specs (`MegatronSettings.layer_spec`):
  - "te": Transformer Engine spec (fused layernorm-linear, TE attention). Needs transformer-engine.
  - "local": megatron-core's own modules; its core attention is unfused (scores materialised).
  - "sdpa": the local spec with core attention replaced by `SDPACoreAttention` (torch's
    scaled_dot_product_attention: flash / cuDNN / memory-efficient kernels), Megatron's documented
    extension point (a layer spec's `core_attention` submodule). Flash attention without TE.
  - "auto": "te" when transformer_engine imports, else "sdpa".

Optimizers (`MegatronSettings.optimizer`):
  - "megatron": Megatron's DistributedDataParallel grad buffers (fp32 main grads) + its optimizer
    (`get_megatron_optimizer`: fp32 master weights for bf16 params, clip_grad by global norm; without
    TE/apex its inner optimizer is torch.optim.AdamW). CUDA only (Megatron hard-codes CUDA tensors).
  - "torch": torch.optim.AdamW over fp32 master copies of the params, grads clipped by
    `torch.nn.utils.clip_grad_norm_`; same math, no Megatron wrappers; also runs on CPU.
  - "auto": "megatron" on CUDA, "torch" on CPU.

Kernels (`fusions`, `log_prob_impl`, `rope_fusion`; "auto" = torch.compile'd on CUDA, eager on CPU): Megatron's
bias-SwiGLU / bias-dropout-add fusions, the one-pass log-prob / entropy kernel and a compiled RoPE plugged into
Megatron's `apply_rope_fusion` hook (tasks/train/fused_ops.py). On the H200 they take the ~0.9B Llama from 46% to
54% MFU with step-1 exactness intact (docs/megatron.md).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import socket
from collections.abc import Iterator
from typing import Any

import torch

from rollflow.tasks.model.dtypes import DTYPES
from rollflow.tasks.sync import megatron_names as mn
from rollflow.tasks.train.batch import TrainBatch
from rollflow.tasks.train.data_parallel import DataParallel, shard_rows
from rollflow.tasks.train.data_parallel import sum_stats
from rollflow.tasks.train.fused_ops import install_rope_fusion, token_log_probs
from rollflow.tasks.train.megatron_schedule import (ModelInput, model_inputs, packed_model_inputs, run_schedule,
                                                     schedule_loss_scale, split_context,
                                                     token_budget_micro_batches, unpack_token_values)
from rollflow.tasks.train.pinned import pinned_copy
from rollflow.tasks.train.vocab_parallel import vocab_parallel_log_probs
from rollflow.tasks.train.objective import Denominators, micro_batch_objective, minibatch_steps
from rollflow.tasks.train.torch_backend import split_rows
from rollflow.tasks.train.settings import AlgoConfig, MegatronSettings, OptimConfig

MISSING_MESSAGE = ("train.backend='megatron' needs megatron-core: pip install 'rollflow[megatron]' "
                   "(Python >= 3.12 for megatron-core >= 0.17; 0.16.1 on 3.11)")


# Written last by `MegatronBackend.save_distributed`: only a directory with it is a checkpoint.
COMMIT_MARKER = "rollflow_commit.json"


class MegatronMissing(ImportError):
    pass


def require_megatron():
    try:
        import megatron.core
    except ImportError as exc:
        raise MegatronMissing(MISSING_MESSAGE) from exc
    return megatron.core


def megatron_version() -> str | None:
    try:
        from megatron.core.package_info import __version__
    except ImportError:
        return None
    return __version__


def have_transformer_engine() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install raising at import
        return False
    return True


# ------------------------------------------------------------------------------------ parallel state


@contextlib.contextmanager
def cpu_shims(device: torch.device):
    """On CPU, point megatron-core's hard-coded `torch.cuda.current_device()` (rotary cache, buffers) at the
    CPU while inside. A no-op on CUDA. Only the sdpa layer spec and the torch optimizer run on CPU."""
    if device.type == "cuda":
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = original


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel_state(device: torch.device, seed: int, *, settings: MegatronSettings | None = None,
                        dp: DataParallel | None = None) -> None:
    """torch.distributed (this rank's place from `dp`; one process without it) + Megatron's parallel groups
    (tp / pp / cp from `settings`, data parallel = world / (tp * pp * cp)). Idempotent."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    settings = settings or MegatronSettings()
    if device.type == "cuda":
        torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if dp is not None:
            dist.init_process_group(backend=backend, init_method=dp.init_method, rank=dp.rank,
                                    world_size=dp.world_size)
        elif int(os.environ.get("WORLD_SIZE", 1)) > 1:  # launched by torchrun: its env rendezvous
            dist.init_process_group(backend=backend)
        else:
            # One process: a fresh port every time. A MASTER_PORT inherited from the environment (e.g. set by an
            # earlier backend in the process that started this one) may be in use by now.
            dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                                    world_size=1)
    settings.data_parallel_size(dist.get_world_size())  # one clear error before any group is built
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=settings.tp, pipeline_model_parallel_size=settings.pp,
            virtual_pipeline_model_parallel_size=settings.vpp, context_parallel_size=settings.cp)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_parallel_state() -> None:
    """Undo `init_parallel_state` (Megatron's groups, then the default group)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------- SDPA core attention

_SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}


def varlen_causal_attention():
    """torch's variable-length flash attention as `f(q, k, v, cu_seqlens, max_len, scale)` -> [t, np, hn], causal,
    for [t, np, hn] q and [t, ng, hn] k / v in fp16 / bf16 on CUDA; None where this torch has none. One call for
    all rows of a packed micro-batch, instead of one SDPA launch per row per layer (the packed layout's host cost,
    docs/megatron.md). Its keyword for causality changed across releases (is_causal, then window_size)."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "is_causal" in params:
        causal = {"is_causal": True}
    elif "window_size" in params:
        causal = {"window_size": (-1, 0)}
    else:
        return None
    gqa = "enable_gqa" in params

    def attend(q, k, v, cu_seqlens, max_len: int, scale: float):
        if k.shape[1] != q.shape[1]:
            if gqa:
                causal_gqa = {**causal, "enable_gqa": True}
                return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale, **causal_gqa)
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale, **causal)

    return attend


def make_sdpa_core_attention(sdpa_backends: tuple[str, ...] = ()):
    """A core-attention module class for Megatron layer specs that calls torch SDPA (causal).

    `sdpa_backends` pins torch's kernel choice in priority order (e.g. ("cudnn", "flash")); empty: torch
    picks. Pinning keeps the forward kernel the same with and without grad, which step-1 exactness needs.
    """
    from megatron.core.transformer.module import MegatronModule

    backends = tuple(sdpa_backends)
    for name in backends:
        if name not in _SDPA_BACKENDS:
            raise ValueError(f"sdpa backend {name!r}: expected one of {sorted(_SDPA_BACKENDS)}")

    class SDPACoreAttention(MegatronModule):
        """Drop-in for megatron's DotProductAttention: [s, b, np, hn] q/k/v -> [s, b, np * hn]."""

        def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                     attention_dropout: float | None = None, softmax_scale: float | None = None,
                     cp_comm_type: str | None = None, pg_collection=None, **_unused):
            super().__init__(config=config)
            self.cp_size = getattr(config, "context_parallel_size", 1)
            self._cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
            if getattr(config, "softmax_type", "vanilla") != "vanilla":
                raise ValueError("SDPACoreAttention supports only softmax_type='vanilla'")
            self.attn_mask_type = attn_mask_type
            self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
            self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
            self._kernel = None
            self._varlen = varlen_causal_attention()
            if backends:
                from torch.nn.attention import SDPBackend

                self._kernel = [getattr(SDPBackend, _SDPA_BACKENDS[n]) for n in backends]

        @staticmethod
        def _expand_kv(q, k, v):
            """GQA: the kv heads repeated to the query heads (portable across SDPA kernels)."""
            heads = q.shape[1]
            if k.shape[1] != heads:
                k = k.repeat_interleave(heads // k.shape[1], dim=1)
                v = v.repeat_interleave(heads // v.shape[1], dim=1)
            return k, v

        def _sdpa(self, q, k, v):
            """Causal SDPA of [b, np, s, hn] q and [b, ng, s, hn] k / v."""
            k, v = self._expand_kv(q, k, v)
            ctx = contextlib.nullcontext()
            if self._kernel is not None and q.is_cuda:
                from torch.nn.attention import sdpa_kernel

                ctx = sdpa_kernel(self._kernel, set_priority=True)
            with ctx:
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0.0,
                    is_causal=True, scale=self.softmax_scale)

        def _attend(self, q, k, v, mask):
            """SDPA of [b, np, sq, hn] q and [b, ng, sk, hn] k / v under `mask` (a torch attention bias)."""
            k, v = self._expand_kv(q, k, v)
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, scale=self.softmax_scale)

        def _cp(self):
            """(group, rank) of the context-parallel group."""
            from megatron.core import parallel_state

            group = self._cp_group or parallel_state.get_context_parallel_group()
            return group, torch.distributed.get_rank(group)

        def _context_parallel(self, query, key, value, packed_seq_params):
            """This rank's queries (its two chunks of every row, context_parallel.py) against every rank's keys
            and values, gathered in sequence order. Padded: [s/cp, b, n, hn]; packed: [t/cp, n, hn] with the
            whole sequence's row bounds in `packed_seq_params`."""
            from rollflow.tasks.train import context_parallel as cpl

            group, rank = self._cp()
            cp = self.cp_size
            if packed_seq_params is None:
                s_local, b, heads, dim = query.shape
                _positions, order = cpl.padded_layout(s_local * cp, cp, rank)
                k, v = cpl.gather_context(torch.stack((key, value), dim=-1), order, group).unbind(-1)
                out = cpl.chunk_attention(self._attend, query.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3),
                                          v.permute(1, 2, 0, 3), cp=cp, rank=rank)
                return out.permute(2, 0, 1, 3).reshape(s_local, b, heads * dim)
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"SDPACoreAttention: packed format {packed_seq_params.qkv_format!r}; only 'thd'")
            bounds = packed_seq_params.bounds
            order = packed_seq_params.cp_order
            k, v = cpl.gather_context(torch.stack((key, value), dim=-1), order, group).unbind(-1)
            mine = cpl.local_bounds(bounds, cp)
            t, heads, dim = query.shape
            pieces = []
            for (a, b), (la, lb) in zip(zip(bounds[:-1], bounds[1:]), zip(mine[:-1], mine[1:])):
                if b > a:
                    q_row, k_row, v_row = (x.transpose(0, 1).unsqueeze(0) for x in (query[la:lb], k[a:b], v[a:b]))
                    out = cpl.chunk_attention(self._attend, q_row, k_row, v_row, cp=cp, rank=rank)
                    pieces.append(out[0].transpose(0, 1))
            return torch.cat(pieces, dim=0).reshape(t, heads * dim)

        def _packed(self, query, key, value, packed_seq_params):
            """THD: [t, np, hn] q/k/v holding the rows end to end -> [t, np * hn]; each row attends causally
            to itself only: one variable-length flash call (CUDA, fp16 / bf16, no dropout), else one SDPA call per
            row (no [t, t] mask, no padding)."""
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"SDPACoreAttention: packed format {packed_seq_params.qkv_format!r}; only 'thd'")
            t, heads, dim = query.shape
            if (self._varlen is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
                    and not (self.training and self.dropout)):
                out = self._varlen(query, key, value, packed_seq_params.cu_seqlens_q,
                                   int(packed_seq_params.max_seqlen_q), self.softmax_scale)
                return out.reshape(t, heads * dim)
            bounds = getattr(packed_seq_params, "bounds", None) or packed_seq_params.cu_seqlens_q.tolist()
            pieces = []
            for a, b in zip(bounds[:-1], bounds[1:]):
                if b > a:
                    q, k, v = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
                    pieces.append(self._sdpa(q, k, v)[0].transpose(0, 1))  # [s, np, hn]
            return torch.cat(pieces, dim=0).reshape(t, heads * dim)

        def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **_unused):
            if attention_bias is not None:
                raise ValueError("SDPACoreAttention: attention_bias is not supported")
            if self.cp_size > 1:
                return self._context_parallel(query, key, value, packed_seq_params)
            if packed_seq_params is not None:
                return self._packed(query, key, value, packed_seq_params)
            sq, b, heads, dim = query.shape
            # [s, b, n, hn] -> [b, n, s, hn]
            out = self._sdpa(query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3))
            return out.permute(2, 0, 1, 3).reshape(sq, b, heads * dim)

    return SDPACoreAttention


# ---------------------------------------------------------------------------------- model building


def _rope(hf_config) -> dict[str, Any]:
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"rotary_base": mn._rope_theta(hf_config)}
    if rope_type in (None, "default"):
        return out
    if rope_type == "llama3":
        if (params.get("low_freq_factor", 1.0), params.get("high_freq_factor", 4.0),
                params.get("original_max_position_embeddings", 8192)) != (1.0, 4.0, 8192):
            raise NotImplementedError(f"llama3 rope scaling with non-default parameters {params} is not mapped")
        out.update(rope_scaling=True, rope_scaling_factor=float(params.get("factor", 8.0)))
        return out
    raise NotImplementedError(f"rope_type={rope_type!r} is not mapped to Megatron (default and llama3 are)")


def resolve_layer_spec(name: str) -> str:
    if name == "auto":
        return "te" if have_transformer_engine() else "sdpa"
    if name == "te" and not have_transformer_engine():
        raise ImportError("train.megatron.layer_spec='te' needs transformer-engine (pip install 'rollflow[te]'); "
                          "use 'sdpa' (torch SDPA core attention) or 'local'")
    return name


def build_transformer_config(hf_config, settings: MegatronSettings, *, dtype: torch.dtype, device: torch.device,
                             random_init: bool):
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


def build_layer_spec(spec: str, settings: MegatronSettings, *, qk_layernorm: bool = False):
    from megatron.core.models.gpt import gpt_layer_specs as specs

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


def build_block_spec(spec: str, settings: MegatronSettings, config, *, qk_layernorm: bool = False,
                     vp_stage: int | None = None):
    """The layer spec, or for the torch specs the whole block's (its layers and the final norm: Megatron
    would build that one with its own torch norm, which refuses sequence parallelism)."""
    layer = build_layer_spec(spec, settings, qk_layernorm=qk_layernorm)
    if spec == "te":
        return layer
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    count = get_num_layers_to_build(config, vp_stage=vp_stage,
                                    pp_rank=parallel_state.get_pipeline_model_parallel_rank())
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


def build_gpt_model(hf_config, settings: MegatronSettings, *, dtype: torch.dtype, device: torch.device,
                    random_init: bool = False, vp_stage: int | None = None):
    """This rank's megatron-core GPTModel (its TP shard of its pipeline stage; with vpp, of its virtual stage
    `vp_stage`) for an HF Llama / Qwen2 / Qwen3 config; returns (model, layout, spec). The layout's pipeline
    stages are the virtual ones (pp * vpp, `virtual_stage`). Parallel state must be initialised."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    settings.check_model(hf_config.num_hidden_layers,
                         getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads)
    config, spec = build_transformer_config(hf_config, settings, dtype=dtype, device=device, random_init=random_init)
    if spec == "local" and settings.cp > 1:
        raise ValueError("train.megatron.cp > 1 needs layer_spec 'sdpa' or 'te': Megatron's local attention refuses "
                         "context parallelism")
    layout = mn.MegatronLayout.from_hf_config(hf_config, spec="te" if spec == "te" else "local", tp_size=settings.tp,
                                              pp_size=settings.pp * (settings.vpp or 1),
                                              make_vocab_size_divisible_by=settings.make_vocab_size_divisible_by)
    model = GPTModel(
        config=config,
        transformer_layer_spec=build_block_spec(spec, settings, config, qk_layernorm=layout.qk_layernorm,
                                                vp_stage=vp_stage),
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


def virtual_stage(pp_rank: int, pp_size: int, vp_stage: int | None) -> int:
    """Index of a model chunk in the layer order: interleaving gives rank r's chunk v the layers of stage v*pp + r."""
    return pp_rank if vp_stage is None else vp_stage * pp_size + pp_rank


def load_hf_weights(model: torch.nn.Module, hf_state: dict[str, torch.Tensor], layout: mn.MegatronLayout,
                    vp_stage: int | None = None) -> None:
    """Copy an HF state dict into this rank's Megatron model (its tp shard of its pp stage) through the
    converter; strict on names (and the converter is strict on HF tensors it does not map)."""
    from megatron.core import parallel_state

    if layout.tp_size * layout.pp_size == 1:
        converted = mn.hf_to_megatron(hf_state, layout)
    else:
        stage = virtual_stage(parallel_state.get_pipeline_model_parallel_rank(),
                              parallel_state.get_pipeline_model_parallel_world_size(), vp_stage)
        converted = mn.to_megatron_shards(hf_state, layout)[(stage, parallel_state.get_tensor_model_parallel_rank())]
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    missing = sorted(set(own) - set(converted))
    unexpected = sorted(set(converted) - set(own))
    if missing or unexpected:
        raise mn.ConversionError(f"HF -> Megatron names do not match the model: missing {missing[:4]}, "
                                 f"unexpected {unexpected[:4]}")
    with torch.no_grad():
        for name, target in own.items():
            source = converted[name]
            if tuple(source.shape) != tuple(target.shape):
                raise mn.ConversionError(f"{name}: converted shape {tuple(source.shape)} != model's {tuple(target.shape)}")
            target.copy_(source.to(dtype=target.dtype))


def _chunk_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def _layer_groups(weights: dict[str, torch.Tensor]) -> Iterator[list[str]]:
    """Consecutive names of one decoder layer together; every other tensor alone (the export's unit)."""
    group: list[str] = []
    key = None
    for name in weights:
        match = mn._LAYER.match(name)
        this = match.group(1) if match else name
        if group and this != key:
            yield group
            group = []
        group.append(name)
        key = this
    if group:
        yield group


def _gather_shards(part: dict[str, torch.Tensor], tp_size: int, group) -> list[dict[str, torch.Tensor]]:
    """Every TP rank's shard of each tensor in `part`, all-gathered on the device."""
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp_size)]
    for name, tensor in part.items():
        parts = [torch.empty_like(tensor) for _ in range(tp_size)]
        torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
        for rank, piece in enumerate(parts):
            shards[rank][name] = piece
    return shards



# ------------------------------------------------------------------------------------------ log-probs


def _seq_first_logits(*, hidden_states, output_layer, output_weight=None, runtime_gather_output=None,
                      scale_logits=None, **_unused):
    """A GPTModel `output_processor` (megatron-core >= 0.19): the output layer's [s, b, V] logits as they are."""
    logits, _ = output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
    return scale_logits(logits) if scale_logits is not None else logits


def _accepts_output_processor(model) -> bool:
    import inspect

    cls = type(model)
    cached = getattr(cls, "_rollflow_output_processor", None)
    if cached is None:
        cached = "output_processor" in inspect.signature(cls.forward).parameters
        cls._rollflow_output_processor = cached
    return cached


def batch_to(batch: TrainBatch, device: torch.device) -> TrainBatch:
    import dataclasses

    return TrainBatch(**{f.name: (v.to(device, non_blocking=True) if isinstance(v := getattr(batch, f.name), torch.Tensor)
                                  else v) for f in dataclasses.fields(batch)})


# ---------------------------------------------------------------------------------------- the backend


class _MasterAdamW:
    """torch AdamW over fp32 master copies of (bf16) params, global-norm grad clipping."""

    def __init__(self, params: list[torch.nn.Parameter], optim: OptimConfig):
        self.params = params
        self.master = [p.detach().float().clone() if p.dtype != torch.float32 else p for p in params]
        for m in self.master:
            m.requires_grad_(True)
        self.grad_clip = optim.grad_clip
        self.inner = torch.optim.AdamW(self.master, lr=optim.lr, weight_decay=optim.weight_decay,
                                       betas=(optim.adam_beta1, optim.adam_beta2))

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for m in self.master:
            m.grad = None

    def step(self) -> float:
        for p, m in zip(self.params, self.master):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
        norm = torch.nn.utils.clip_grad_norm_(self.master, self.grad_clip)
        if not torch.isfinite(norm):
            return float(norm)  # a NaN/inf gradient never reaches the weights (nor Adam's moments)
        self.inner.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                if m is not p:
                    p.copy_(m)
        return float(norm)

    def state_dict(self) -> dict:
        return {"master": [m.detach() for m in self.master], "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for m, saved in zip(self.master, state["master"]):
                m.copy_(saved)
            for p, m in zip(self.params, self.master):
                if m is not p:
                    p.copy_(m)
        self.inner.load_state_dict(state["inner"])


class MegatronBackend:
    """One rank of the megatron trainer: its TP shard of its pipeline stage, in its data-parallel replica.

    Two paths, by `train.megatron.optimizer`:
      - "megatron" (CUDA; any tp / pp / dp): Megatron's DistributedDataParallel, its schedule
        (`get_forward_backward_func`: 1F1B when pp > 1) with `finalize_model_grads`, its optimizer
        (distributed optimizer optional, global-norm clipping over all model-parallel ranks) and its LR
        scheduler (warmup + decay). Vocab-parallel log-probs when tp > 1.
      - "torch" (one rank; also runs on CPU): rollflow's own micro-batch loop and AdamW on fp32 masters.
    Every rank holds the whole TrainBatch; rank r of the data-parallel group trains on its contiguous share
    of each mini-batch (`data_parallel.shard_rows`), as the torch backend's data parallel does.
    """

    name = "megatron"

    def __init__(self, hf_config, hf_state: dict[str, torch.Tensor] | None, optim: OptimConfig, *,
                 temperature: float = 1.0, keep_ref: bool = True, dp: DataParallel | None = None):
        require_megatron()
        from megatron.core import parallel_state as ps

        torch.set_num_threads(optim.threads)
        torch.manual_seed(optim.seed)
        self.optim_cfg = optim
        self.device = torch.device(optim.device)
        self.settings = optim.megatron.resolved(self.device.type)
        self.temperature = temperature if temperature > 0 else 1.0
        self.dtype = DTYPES[optim.dtype]
        self.optimizer_kind = self.settings.optimizer
        if self.optimizer_kind == "auto":
            self.optimizer_kind = "megatron" if self.device.type == "cuda" else "torch"
        s = self.settings
        megatron_only = [name for name, on in (("use_distributed_optimizer", s.use_distributed_optimizer),
                                               ("overlap_grad_reduce", s.overlap_grad_reduce),
                                               ("lr_warmup_steps", s.lr_warmup_steps > 0),
                                               ("lr_decay_style", s.lr_decay_style != "constant"),
                                               ("max_tokens_per_gpu", s.max_tokens_per_gpu is not None)) if on]
        if s.packing != "off":
            megatron_only.append("packing")
        if self.optimizer_kind == "torch" and megatron_only:
            raise ValueError(f"train.megatron.{megatron_only[0]} needs optimizer='megatron' (Megatron's DDP, optimizer "
                             "and scheduler); with optimizer='torch' it would do nothing")
        world = dp.world_size if dp is not None else int(os.environ.get("WORLD_SIZE", 1))
        if self.optimizer_kind == "torch" and world > 1:
            raise ValueError(f"train.megatron.optimizer='torch' runs one rank (got world size {world}): use "
                             "optimizer='megatron' (Megatron's DDP, schedule and optimizer) for tp / pp / dp > 1")
        init_parallel_state(self.device, optim.seed, settings=self.settings, dp=dp)
        self.tp_rank, self.tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        self.pp_rank, self.pp_size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.cp_rank = ps.get_context_parallel_rank()
        random_init = hf_state is None
        if self.device.type != "cuda" and resolve_layer_spec(self.settings.layer_spec) != "sdpa":
            raise ValueError("on CPU the megatron backend runs only train.megatron.layer_spec='sdpa' (the local "
                             "spec's attention forks Megatron's CUDA RNG tracker)")
        # One model chunk per virtual pipeline stage (vpp); one chunk otherwise. `self.model` is the first.
        self.chunks: list[torch.nn.Module] = []
        for vp in ([None] if self.settings.vpp is None else range(self.settings.vpp)):
            chunk, self.layout, self.layer_spec = build_gpt_model(hf_config, self.settings, dtype=self.dtype,
                                                                  device=self.device, random_init=random_init,
                                                                  vp_stage=vp)
            if hf_state is not None:
                load_hf_weights(chunk, hf_state, self.layout, vp_stage=vp)
            self.chunks.append(chunk)
        self.model = self.chunks[0]
        self._host_weights: dict[tuple, torch.Tensor] | None = None  # set while offloaded
        self._offloaded_opt_params: dict[tuple, torch.Tensor] = {}
        # The reference is the starting policy, frozen: kept as a host copy (pinned on CUDA) and swapped into
        # the one model for the reference pass, so no second model sits in GPU memory (slime does the same).
        self._ref_state: dict[str, torch.Tensor] | None = None
        if keep_ref:
            self._ref_state = {k: v.detach().to("cpu", copy=True) for k, v in self._weights().items()}
            if self.device.type == "cuda":
                self._ref_state = {k: v.pin_memory() for k, v in self._ref_state.items()}
        self._build_optimizer()

    # -- optimizer ---------------------------------------------------------------------------------

    def _build_optimizer(self) -> None:
        optim = self.optim_cfg
        self.scheduler = None
        if self.optimizer_kind == "torch":
            self.ddp = None
            self.ddps: list = []
            self.train_model = self.model
            self.optimizer = _MasterAdamW([p for p in self.model.parameters() if p.requires_grad], optim)
            return
        if self.optimizer_kind != "megatron":
            raise ValueError(f"train.megatron.optimizer={self.optimizer_kind!r}: expected auto, megatron or torch")
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        s = self.settings
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=s.overlap_grad_reduce,
            overlap_param_gather=s.overlap_param_gather, use_distributed_optimizer=s.use_distributed_optimizer)
        # Bucketing (overlap) only on the first chunk, as Megatron-LM does with interleaved stages.
        self.ddps = [DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk,
                                             disable_bucketing=i > 0) for i, chunk in enumerate(self.chunks)]
        self.ddp = self.ddps[0]
        self.train_model = self.ddp
        for chunk in self.chunks:
            # The schedule reduces grads (DP average, tied-embedding and sequence-parallel norm grads) at its end.
            chunk.config.finalize_model_grads_func = finalize_model_grads
            chunk.config.no_sync_func = (self.ddp.no_sync if len(self.ddps) == 1
                                         else [d.no_sync for d in self.ddps])
            if s.overlap_param_gather:
                chunk.config.param_sync_func = (self.ddp.start_param_sync if len(self.ddps) == 1
                                                else [d.start_param_sync for d in self.ddps])
        opt_config = OptimizerConfig(
            optimizer="adam", lr=optim.lr, min_lr=s.min_lr, weight_decay=optim.weight_decay,
            adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=1e-8, clip_grad=optim.grad_clip,
            bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype,
            use_distributed_optimizer=s.use_distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(opt_config, self.ddps)
        decay_steps = s.lr_warmup_steps + (s.lr_decay_steps or 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if s.lr_warmup_steps else optim.lr, max_lr=optim.lr,
            min_lr=optim.lr if s.lr_decay_style == "constant" else s.min_lr, lr_warmup_steps=s.lr_warmup_steps,
            lr_decay_steps=decay_steps, lr_decay_style=s.lr_decay_style, start_wd=optim.weight_decay,
            end_wd=optim.weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant")

    def _zero_grad(self) -> None:
        for ddp in self.ddps:
            ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _optimizer_step(self) -> float:
        if self.ddp is None:
            return self.optimizer.step()
        # Megatron checks for inf only under fp16 loss scaling; bf16/fp32 would clip by a NaN norm and write NaN
        # weights, so look at the reduced grads first (one flag, agreed by every rank).
        grads = [p.main_grad for chunk in self.chunks for p in chunk.parameters()
                 if getattr(p, "main_grad", None) is not None]
        bad = torch.zeros(1, dtype=torch.float32, device=grads[0].device if grads else self.device)
        if grads and not bool(torch.stack([g.float().norm() for g in grads]).isfinite().all()):
            bad += 1
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        if bad.item():
            return float("nan")
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise FloatingPointError("Megatron optimizer step was skipped (inf/nan gradients)")
        self.scheduler.step(increment=1)
        return float(grad_norm)

    @property
    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # -- forward -------------------------------------------------------------------------------------

    def _log_probs(self, model, micro: TrainBatch, *, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced log-prob (and entropy) of every next token, target aligned [B, L-1], fp32, on device."""
        tokens = micro.tokens.to(self.device, torch.long, non_blocking=True)
        position_ids = micro.position_ids.to(self.device, non_blocking=True)
        kwargs = dict(temperature=self.temperature, vocab_size=self.layout.vocab_size,
                      chunk=self.settings.log_prob_chunk, impl=self.settings.log_prob_impl, entropy_grad=entropy_grad)
        with cpu_shims(self.device):
            if _accepts_output_processor(self.model):
                # Sequence-first logits [L, B, V_pad] straight from the output layer: logits[:-1] is then a
                # contiguous prefix, so no [B, L, V] transpose copy and no slice copy (forward or backward).
                logits = model(input_ids=tokens, position_ids=position_ids, attention_mask=None,
                               output_processor=_seq_first_logits)
                lp, ent = token_log_probs(logits[:-1], tokens[:, 1:].t(), **kwargs)
                return lp.t(), ent.t()
            logits = model(input_ids=tokens, position_ids=position_ids, attention_mask=None)  # [B, L, V_pad]
        return token_log_probs(logits[:, :-1], tokens[:, 1:], **kwargs)

    def _forward_kwargs(self) -> dict[str, Any]:
        # megatron-core >= 0.19: sequence-first [s, b, V/tp] logits straight from the output layer (no transpose
        # copy of the logits); older releases return [b, s, V/tp].
        # One stage only: how 0.19 treats the hook on stages without the output layer is not verified here.
        use = self.pp_size == 1 and _accepts_output_processor(self.model)
        return {"output_processor": _seq_first_logits} if use else {}

    def _output_log_probs(self, item: ModelInput, logits: torch.Tensor, *, entropy_grad: bool
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs / entropy [rows, width - 1] of the real rows and columns of the last stage's logits."""
        n, width = item.n_real, item.width
        seq_first = bool(self._forward_kwargs())
        if item.cp > 1:
            return self._context_log_probs(item, logits, seq_first=seq_first, entropy_grad=entropy_grad)
        if item.packed is not None:  # [T, 1, V] / [1, T, V]: every position scores the next packed token
            flat = logits[:-1, 0] if seq_first else logits[0, :-1]
            lp, ent = self._vocab_log_probs(flat, item.tokens[0, 1:], entropy_grad=entropy_grad)
            return unpack_token_values(lp, item), unpack_token_values(ent, item)
        logits = logits[: width - 1, :n] if seq_first else logits[:n, : width - 1]
        target = item.tokens[:n, 1:width]
        target = target.t() if seq_first else target
        lp, ent = self._vocab_log_probs(logits, target, entropy_grad=entropy_grad)
        return (lp.t(), ent.t()) if seq_first else (lp, ent)

    def _context_log_probs(self, item: ModelInput, logits: torch.Tensor, *, seq_first: bool, entropy_grad: bool
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """Context parallel: this rank's positions scored against their next tokens, then every cp rank's values
        gathered back into sequence order (context_parallel.py: each rank's backward keeps its own positions)."""
        from megatron.core import parallel_state as ps

        from rollflow.tasks.train.context_parallel import gather_context

        targets = item.cp_targets.t() if seq_first or item.packed is not None else item.cp_targets
        if item.packed is not None:  # [t, 1, V] / [1, t, V] -> [t, V]
            logits = logits[:, 0] if seq_first else logits[0]
            targets = targets[:, 0]
        lp, ent = self._vocab_log_probs(logits, targets, entropy_grad=entropy_grad)
        if not seq_first and item.packed is None:  # [b, s] -> [s, b]: the gather runs along dim 0
            lp, ent = lp.t(), ent.t()
        both = gather_context(torch.stack((lp, ent), dim=-1), item.cp_order, ps.get_context_parallel_group(),
                              backward="slice")
        lp, ent = both.unbind(-1)
        if item.packed is not None:
            return unpack_token_values(lp[:-1], item), unpack_token_values(ent[:-1], item)
        return lp[: item.width - 1, : item.n_real].t(), ent[: item.width - 1, : item.n_real].t()

    def _vocab_log_probs(self, logits: torch.Tensor, target: torch.Tensor, *, entropy_grad: bool
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """log p(target) and entropy over the real vocabulary, reduced over the TP group when it is split."""
        if self.tp_size > 1:
            from megatron.core import parallel_state as ps

            lp, ent = vocab_parallel_log_probs(logits, target, vocab_start=self.tp_rank * logits.shape[-1],
                                               vocab_size=self.layout.vocab_size, temperature=self.temperature,
                                               group=ps.get_tensor_model_parallel_group())
        else:
            lp, ent = token_log_probs(logits, target, temperature=self.temperature, vocab_size=self.layout.vocab_size,
                                      chunk=self.settings.log_prob_chunk, impl=self.settings.log_prob_impl,
                                      entropy_grad=entropy_grad)
        return lp, ent

    def _model_inputs(self, batch: TrainBatch, micros: list[TrainBatch]) -> list[ModelInput]:
        items = self._whole_model_inputs(batch, micros)
        cp = self.settings.cp
        return items if cp == 1 else [split_context(item, cp, self.cp_rank) for item in items]

    def _whole_model_inputs(self, batch: TrainBatch, micros: list[TrainBatch]) -> list[ModelInput]:
        """The micro-batches as the whole model sees them (before a context-parallel split)."""
        cp = self.settings.cp
        # Sequence parallel: each cp rank's share a multiple of tp; context parallel: 2 x cp chunks per sequence.
        multiple = cp * math.lcm(self.tp_size if self.settings.sequence_parallel else 1, 2 if cp > 1 else 1)
        empty = batch.select(slice(0, 0))
        if self.settings.packing == "thd":
            if len(self.chunks) > 1 and len(micros) < self.pp_size:
                micros = list(micros or [empty]) + [empty] * (self.pp_size - max(len(micros), 1))
            multiple = math.lcm(multiple, self.settings.pack_multiple)
            return packed_model_inputs(micros, width_multiple=multiple, device=self.device, empty=empty,
                                       same_length=self.pp_size > 1, row_multiple=2 * cp if cp > 1 else 1)
        if self.pp_size == 1:  # no activations between stages: each micro-batch keeps its own rows and width
            return [item for m in (micros or [empty])
                    for item in model_inputs([m], rows=max(m.size, 1), device=self.device, empty=m,
                                             width_multiple=multiple)]
        if len(self.chunks) > 1 and len(micros) < self.pp_size:
            # The interleaved schedule needs at least pp micro-batches: all-padding ones fill up (loss 0).
            micros = list(micros or [empty]) + [empty] * (self.pp_size - max(len(micros), 1))
        return model_inputs(micros, rows=self.optim_cfg.micro_batch_size, device=self.device, empty=empty,
                            width_multiple=multiple)

    @property
    def _reports_stats(self) -> bool:
        """One rank per data-parallel replica reports the replica's statistics (its last stage, tp / cp rank 0)."""
        return self.pp_rank == self.pp_size - 1 and self.tp_rank == 0 and self.cp_rank == 0

    def _schedule_log_probs(self, batch: TrainBatch) -> torch.Tensor:
        rows = shard_rows(batch.size, self.dp_rank, self.dp_size)
        mine = batch.select(rows)
        micros = self._micro_batches(mine)

        def loss_fn(item, logits, _num_microbatches):
            lp, _ = self._output_log_probs(item, logits, entropy_grad=False)
            return logits.new_zeros(()), {"log_probs": lp.float().cpu()}

        with cpu_shims(self.device):
            data = run_schedule(self.chunks, self._model_inputs(mine, micros), loss_fn, forward_only=True,
                                forward_kwargs=self._forward_kwargs())
        out = torch.zeros((batch.size, batch.tokens.shape[1] - 1), dtype=torch.float32)
        if self._reports_stats and mine.size:
            row = rows.start
            for d in data:  # micro-batches in order; token-budget ones are narrower than the batch
                lp = d["log_probs"]
                out[row:row + lp.shape[0], : lp.shape[1]] = lp
                row += lp.shape[0]
        # Every rank gets every row: the sum of the reporting ranks' disjoint rows (zeros elsewhere) is exact.
        flat = out.to(self._collective_device())
        torch.distributed.all_reduce(flat)
        return flat.cpu()

    def _collective_device(self) -> torch.device:
        return self.device if torch.distributed.get_backend() == "nccl" else torch.device("cpu")

    def reference_tensors(self) -> dict[str, torch.Tensor] | None:
        """The frozen reference's host copies by the model's own names (None without a reference): what the
        alignment drills perturb in place."""
        return self._ref_state

    def reset_reference(self) -> None:
        """The reference becomes the current weights (a drill that replaced the starting weights)."""
        if self._ref_state is not None:
            with torch.no_grad():
                for name, tensor in self._weights().items():
                    self._ref_state[name].copy_(tensor.detach())

    @torch.no_grad()
    def compute_log_probs(self, batch: TrainBatch, which: str = "policy") -> torch.Tensor:
        if which != "policy" and self._ref_state is None:
            raise RuntimeError("reference log-probs requested but the trainer was built without a reference model")
        with self._weights_of(which):
            was_training = self.model.training
            for chunk in self.chunks:
                chunk.eval()
            if self.ddp is not None:
                lp = self._schedule_log_probs(batch)
            else:
                # Same micro-batch split as the training forward: numerics then match bit for bit.
                lp = torch.cat([self._log_probs(self.model, mb, entropy_grad=False)[0].cpu()
                                for mb in split_rows(batch, self.optim_cfg.micro_batch_size)], dim=0)
            for chunk in self.chunks:
                chunk.train(was_training)
        return lp

    def _weights(self) -> dict[str, torch.Tensor]:
        """Every chunk's tensors, keyed `{chunk}/{name}`."""
        return {f"{i}/{k}": v for i, chunk in enumerate(self.chunks) for k, v in _chunk_weights(chunk).items()}

    @contextlib.contextmanager
    def _weights_of(self, which: str):
        """The policy's weights as they are, or the reference's swapped in (and the policy's put back after)."""
        if which == "policy":
            yield
            return
        own = self._weights()
        saved = {k: v.detach().to("cpu", copy=True) for k, v in own.items()}
        with torch.no_grad():
            for k, v in own.items():
                v.copy_(self._ref_state[k], non_blocking=True)
        try:
            yield
        finally:
            with torch.no_grad():
                for k, v in own.items():
                    v.copy_(saved[k], non_blocking=True)

    def micro_step(self, micro: TrainBatch, algo: AlgoConfig, denom: Denominators) -> dict[str, float]:
        """Forward, objective and backward of one micro-batch (grads accumulate); the optimizer='torch' path."""
        log_probs, entropy = self._log_probs(self.train_model, micro, entropy_grad=algo.entropy_coef > 0)
        loss, stats = micro_batch_objective(log_probs, entropy, batch_to(micro, self.device), algo, denom)
        loss.backward()
        return stats

    def _micro_batches(self, rows: TrainBatch) -> list[TrainBatch]:
        """This rank's rows as micro-batches: by token budget (`max_tokens_per_gpu`) or `micro_batch_size` rows."""
        budget = self.settings.max_tokens_per_gpu
        if budget is not None:  # per GPU: a context-parallel group holds cp times as many tokens
            return token_budget_micro_batches(rows, budget * self.settings.cp, packed=self.settings.packing == "thd")
        size = self.optim_cfg.micro_batch_size
        return [rows.select(slice(i, i + size)) for i in range(0, rows.size, size)]

    def _schedule_micro_batches(self, batch: TrainBatch, micros: list[TrainBatch], algo: AlgoConfig,
                                denom: Denominators) -> dict[str, float]:
        """This rank's micro-batches of one mini-batch through Megatron's schedule; summed statistics."""
        if self.settings.max_tokens_per_gpu is not None:  # minibatch_steps handed the rank's rows as one
            micros = [m for rows in micros for m in self._micro_batches(rows)]

        def loss_fn(item: ModelInput, logits: torch.Tensor, num_microbatches: int):
            if item.n_real == 0:  # a rank without rows: a zero loss that still reaches every parameter
                return logits.sum() * 0.0, {}
            lp, ent = self._output_log_probs(item, logits, entropy_grad=algo.entropy_coef > 0)
            loss, stats = micro_batch_objective(lp, ent, batch_to(item.micro, self.device), algo, denom)
            return loss * schedule_loss_scale(num_microbatches, self.dp_size), stats

        with cpu_shims(self.device):
            data = run_schedule(self.ddps, self._model_inputs(batch, micros), loss_fn, forward_only=False,
                                forward_kwargs=self._forward_kwargs())
        acc: dict[str, float] = {}
        if self._reports_stats:
            for stats in data:
                for key, value in stats.items():
                    acc[key] = acc.get(key, 0.0) + value
        return acc

    def train(self, batch: TrainBatch, algo: AlgoConfig, on_step=None) -> dict[str, float]:
        """`num_steps_per_rollout` optimizer steps over consecutive mini-batches; mean of step stats
        (`on_step` gets each step's own: objective.minibatch_steps)."""
        # train(): Megatron's activation recompute runs only in training mode. Dropout is 0, so the training
        # forward is still the same function as the scoring forward (step-1 exactness).
        for chunk in self.chunks:
            chunk.train()
        if self.ddp is None:
            return minibatch_steps(batch, self.optim_cfg.num_steps_per_rollout, self.optim_cfg.micro_batch_size,
                                   zero_grad=self._zero_grad,
                                   micro_step=lambda micro, denom: self.micro_step(micro, algo, denom),
                                   optimizer_step=self._optimizer_step, on_step=on_step)
        from rollflow.tasks.train.objective import STAT_NAMES

        names = STAT_NAMES + tuple(k for k in ("kl_loss",) if k not in STAT_NAMES)
        rows_per_micro = self.optim_cfg.micro_batch_size if self.settings.max_tokens_per_gpu is None else batch.size
        return minibatch_steps(
            batch, self.optim_cfg.num_steps_per_rollout, rows_per_micro,
            zero_grad=self._zero_grad, micro_step=None, optimizer_step=self._optimizer_step,
            local_rows=lambda n: shard_rows(n, self.dp_rank, self.dp_size),
            sum_stats=lambda stats: sum_stats(stats, None, names),
            run_micro_batches=lambda micros, denom: self._schedule_micro_batches(batch, micros, algo, denom),
            on_step=on_step)

    # -- colocated placement: free the GPU while the engine generates -----------------------------------

    def _inner_optimizers(self) -> list:
        """The torch optimizers inside Megatron's (chained) optimizer: they hold the Adam state and, in mixed
        precision, the fp32 master copies."""
        outer = getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]
        return [o.optimizer for o in outer if getattr(o, "optimizer", None) is not None]

    def offload(self) -> None:
        """Move this rank's weights, main grads and optimizer state to host memory (pinned) so a colocated
        engine can use the GPU; `onload` brings them back, bit for bit. A no-op on CPU and when offloaded.

        Megatron's own `optimizer.offload_to_cpu` is not used: it moves the optimizer's params by `p.data =
        p.data.cpu()`, which reads freed storage when they are views into DDP's param buffer (distributed
        optimizer: 'CUDA error: invalid argument' on the H200) and, for fp32 params, breaks that aliasing.
        Here every tensor is moved once, by what owns its storage: DDP buffers resize their own storage
        (views stay valid), other parameters and the optimizer's own tensors (Adam state, fp32 masters) are
        copied to pinned host memory and their device storage released."""
        if self.device.type != "cuda" or self._host_weights is not None:
            return
        if self.ddp is None:
            raise NotImplementedError("offload needs train.megatron.optimizer='megatron' (Megatron's grad buffers "
                                      "and optimizer state know how to move); optimizer='torch' keeps its state")
        torch.cuda.synchronize()
        buffers = [b for ddp in self.ddps for b in ddp.buffers + list(getattr(ddp, "expert_parallel_buffers", []))]
        owned = {t.untyped_storage().data_ptr() for b in buffers for t in (b.param_data, b.grad_data)
                 if t is not None and t.untyped_storage().size() > 0}
        host: dict[tuple, torch.Tensor] = {}

        def stash(key: tuple, tensor: torch.Tensor) -> None:
            host[key] = pinned_copy(tensor)

        params = {(i, name): param for i, chunk in enumerate(self.chunks) for name, param in chunk.named_parameters()}
        for key, param in params.items():  # parameters outside DDP's param buffer
            if param.is_cuda and param.untyped_storage().data_ptr() not in owned:
                stash(("param",) + key, param.data)
        model_storages = {p.untyped_storage().data_ptr() for p in params.values()} | owned
        extra: dict[tuple, torch.Tensor] = {}  # optimizer params that are its own tensors (fp32 masters)
        for o, inner in enumerate(self._inner_optimizers()):
            for g, group in enumerate(inner.param_groups):
                for j, p in enumerate(group["params"]):
                    if p.is_cuda and p.untyped_storage().data_ptr() not in model_storages:
                        stash(("opt_param", o, g, j), p.data)
                        extra[("opt_param", o, g, j)] = p
            for j, state in enumerate(inner.state.values()):
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and v.is_cuda:
                        stash(("opt_state", o, j, k), v)
        torch.cuda.synchronize()
        for b in buffers:  # grad buffers, and the param buffer of the distributed optimizer
            b.offload_to_cpu(move_params=True, move_grads=True)
        for key, param in params.items():
            if ("param",) + key in host:
                param.data = torch.empty(0, dtype=param.dtype, device=self.device)
        for key, p in extra.items():
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        for o, inner in enumerate(self._inner_optimizers()):
            for j, state in enumerate(inner.state.values()):
                for k in list(state):
                    if ("opt_state", o, j, k) in host:
                        state[k] = host[("opt_state", o, j, k)]
        self._host_weights = host
        self._offloaded_opt_params = extra
        torch.cuda.empty_cache()

    def onload(self) -> None:
        """Undo `offload`: weights, (zeroed) grad buffers and optimizer state back on the GPU."""
        if self._host_weights is None:
            return
        host = self._host_weights
        for ddp in self.ddps:
            for buffer in ddp.buffers + list(getattr(ddp, "expert_parallel_buffers", [])):
                buffer.reload_from_cpu(move_params=True, move_grads=True)
        for i, chunk in enumerate(self.chunks):
            for name, param in chunk.named_parameters():
                if ("param", i, name) in host:
                    param.data = host[("param", i, name)].to(self.device, non_blocking=True)
        for key, p in self._offloaded_opt_params.items():
            p.data = host[key].to(self.device, non_blocking=True)
        for o, inner in enumerate(self._inner_optimizers()):
            for j, state in enumerate(inner.state.values()):
                for k in list(state):
                    if ("opt_state", o, j, k) in host:
                        state[k] = host[("opt_state", o, j, k)].to(self.device, non_blocking=True)
        torch.cuda.synchronize()
        self._host_weights = None
        self._offloaded_opt_params = {}

    # -- weights and checkpoints -----------------------------------------------------------------------

    def named_weights(self) -> dict[str, torch.Tensor]:
        """HF-named tensors of the whole model (vocab padding removed), host copies, for the engine sync and
        `rollflow.tasks.sync.parity`: `export_buckets` collected. Every rank returns the same full dict (a
        collective when the model is sharded)."""
        return {name: t.to("cpu", copy=True) for bucket in self.export_buckets(1 << 30) for name, t in bucket}

    def export_buckets(self, bucket_bytes: int, dtype: torch.dtype | None = None
                       ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The whole model's HF-named tensors on this rank's device, about `bucket_bytes` (in `dtype`, when given)
        at a time, for the sync paths: no whole-model copy and no host round trip.

        Each pipeline stage converts its own layers, one layer at a time: the layer's TP shards all-gathered on
        the device, merged and renamed with the stage's layer offset. Each bucket is then broadcast over the
        pipeline group from its stage, so every rank gets the same buckets in the same order. Every rank of the
        model must iterate this to the end together (the gathers and broadcasts are collectives); a bucket's
        tensors may be views of the live weights: read them before the next optimizer step."""
        from rollflow.tasks.sync.buckets import buckets_by_bytes

        for stage in range(self.pp_size):
            if stage == self.pp_rank:
                for bucket in buckets_by_bytes(self._stage_hf_tensors(dtype), bucket_bytes):
                    yield self._share_bucket(bucket, stage)
                if self.pp_size > 1:
                    self._share_bucket(None, stage)  # the stage's end
            else:
                while (bucket := self._share_bucket(None, stage)) is not None:
                    yield bucket

    def _stage_hf_tensors(self, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group() if self.tp_size > 1 else None
        for vp, chunk in enumerate(self.chunks):
            index = virtual_stage(self.pp_rank, self.pp_size, vp if self.settings.vpp else None)
            local = _chunk_weights(chunk)
            for names in _layer_groups(local):
                part = {name: local[name].detach() for name in names}
                shards = [part] if group is None else _gather_shards(part, self.tp_size, group)
                for name, tensor in mn.export_stage_to_hf(shards, self.layout, index).items():
                    yield name, tensor if dtype is None else tensor.to(dtype)

    def _share_bucket(self, bucket: list[tuple[str, torch.Tensor]] | None, stage: int
                      ) -> list[tuple[str, torch.Tensor]] | None:
        """`stage`'s bucket on every rank of the pipeline group (None from the stage: its end)."""
        if self.pp_size == 1:
            return bucket
        from megatron.core import parallel_state as ps

        group = ps.get_pipeline_model_parallel_group()
        src = torch.distributed.get_global_rank(group, stage)
        owner = stage == self.pp_rank
        meta: list = [None if not owner or bucket is None
                      else [(name, tuple(t.shape), t.dtype) for name, t in bucket]]
        torch.distributed.broadcast_object_list(meta, src=src, group=group,
                                                device=self.device if self.device.type == "cuda" else None)
        if meta[0] is None:
            return None
        tensors = [t.contiguous() for _, t in bucket] if owner else \
            [torch.empty(shape, dtype=dt, device=self.device) for _, shape, dt in meta[0]]
        for tensor in tensors:
            torch.distributed.broadcast(tensor, src=src, group=group)
        return [(name, tensor) for (name, _, _), tensor in zip(meta[0], tensors)]

    def save_distributed(self, directory: str) -> None:
        """Megatron's distributed checkpoint (torch_dist): every rank writes its own shards of the model and
        of the optimizer, no rank gathers the whole state; loadable at another tp / pp / dp layout.

        Commit protocol as for rollouts: the payload first, `COMMIT_MARKER` last (rank 0, after a barrier);
        a directory without the marker is not a checkpoint. `directory` is a path every rank can write (a
        shared filesystem on several hosts) and must not hold an earlier checkpoint.
        """
        import json

        from megatron.core import dist_checkpointing

        path = os.path.abspath(directory)
        if os.path.exists(os.path.join(path, COMMIT_MARKER)):
            raise FileExistsError(f"{path} already holds a committed checkpoint; checkpoints are immutable")
        if torch.distributed.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
        torch.distributed.barrier()
        dist_checkpointing.save(self._sharded_state(), path)
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            meta = {"format": "rollflow-megatron-dist-1", "optimizer_kind": self.optimizer_kind,
                    "layout": {"tp": self.tp_size, "pp": self.pp_size, "dp": self.dp_size}}
            with open(os.path.join(path, COMMIT_MARKER), "w") as fh:
                json.dump(meta, fh)
        torch.distributed.barrier()

    def load_distributed(self, directory: str) -> None:
        """Load a `save_distributed` checkpoint, written at any tp / pp / dp layout, into this one."""
        import json

        from megatron.core import dist_checkpointing

        path = os.path.abspath(directory)
        marker = os.path.join(path, COMMIT_MARKER)
        if not os.path.exists(marker):
            raise FileNotFoundError(f"{path} has no {COMMIT_MARKER}: not a committed megatron checkpoint (an "
                                    "interrupted save, or another format)")
        with open(marker) as fh:
            meta = json.load(fh)
        if meta.get("optimizer_kind") != self.optimizer_kind:
            raise ValueError(f"checkpoint optimizer {meta.get('optimizer_kind')!r} != this backend's "
                             f"{self.optimizer_kind!r}")
        loaded = dist_checkpointing.load(self._sharded_state(loading=True), path)
        for key, chunk in self._chunk_keys():
            missing, unexpected = chunk.load_state_dict(loaded[key], strict=False)
            missing = [k for k in missing if not k.endswith("_extra_state")]
            if missing or unexpected:
                raise ValueError(f"checkpoint does not fit the model: missing {missing[:4]}, "
                                 f"unexpected {unexpected[:4]}")
        if "optimizer" in loaded:
            self.optimizer.load_state_dict(loaded["optimizer"])
        if self.scheduler is not None and "scheduler" in loaded:
            self.scheduler.load_state_dict(loaded["scheduler"])

    @property
    def sharded(self) -> bool:
        """True when no rank holds the whole state (tp / pp / cp > 1, virtual stages, or optimizer state sharded over
        DP): checkpoints are then `save_distributed` on every rank, and reading the weights is a collective."""
        return (self.settings.model_parallel_size > 1 or len(self.chunks) > 1
                or (self.settings.use_distributed_optimizer and self.dp_size > 1))

    def all_ranks_finite(self) -> bool:
        """Whether every rank's weight shards are free of NaN / inf (a collective: call it on every rank)."""
        local = all(bool(torch.isfinite(t).all()) for t in self._weights().values() if t.is_floating_point())
        flag = torch.tensor([1.0 if local else 0.0], device=self._collective_device())
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag.item() > 0)

    def _chunk_keys(self) -> list[tuple[str, torch.nn.Module]]:
        # Megatron-LM's names: "model", or "model0", "model1", ... with virtual pipeline stages.
        if len(self.chunks) == 1:
            return [("model", self.model)]
        return [(f"model{i}", chunk) for i, chunk in enumerate(self.chunks)]

    def _sharded_state(self, loading: bool = False) -> dict:
        # Sharded keys carry global layer ids (vp_stage-aware offsets), so any layout can load them.
        state: dict[str, Any] = {key: chunk.sharded_state_dict() for key, chunk in self._chunk_keys()}
        model_state = dict(state)
        if self.ddp is not None:
            # is_loading: Megatron creates the (empty) Adam moments first, so the load has tensors to fill.
            state["optimizer"] = self.optimizer.sharded_state_dict(model_state, is_loading=loading)
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def checkpoint_bytes(self) -> bytes:
        if len(self.chunks) > 1:
            raise NotImplementedError("virtual pipeline stages checkpoint through save_distributed only")
        buf = io.BytesIO()
        model_state = {k: v for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}
        torch.save({"format": "rollflow-megatron-1", "model": model_state,
                    "optimizer_kind": self.optimizer_kind, "optimizer": self.optimizer.state_dict(),
                    "rng": torch.get_rng_state()}, buf)
        return buf.getvalue()

    def load_checkpoint_bytes(self, data: bytes) -> None:
        # weights_only: a checkpoint is data, never code.
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        if state.get("format") != "rollflow-megatron-1":
            raise ValueError("not a megatron-backend checkpoint (format tag missing); was it written by train.backend="
                             "'torch'?")
        if state["optimizer_kind"] != self.optimizer_kind:
            raise ValueError(f"checkpoint optimizer {state['optimizer_kind']!r} != this backend's "
                             f"{self.optimizer_kind!r}")
        missing, unexpected = self.model.load_state_dict(state["model"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"checkpoint does not fit the model: missing {missing[:4]}, unexpected {unexpected[:4]}")
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])


def build_megatron_backend(model_dir, optim: OptimConfig, *, temperature: float,
                           dp: DataParallel | None = None) -> MegatronBackend:
    """From a local HF model directory (config.json + safetensors); `dp`: this rank's place in the trainer."""
    require_megatron()
    from rollflow.tasks.model.tiny import load_model

    hf_model = load_model(model_dir)
    state = {k: v.detach() for k, v in hf_model.state_dict().items()}
    backend = MegatronBackend(hf_model.config, state, optim, temperature=temperature, dp=dp)
    del hf_model, state
    return backend
