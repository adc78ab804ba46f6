"""The `sdpa` layer spec's core attention: torch's scaled_dot_product_attention (flash / cuDNN / memory-efficient
kernels) behind Megatron's documented extension point, a layer spec's `core_attention` submodule. Flash attention
without Transformer Engine; packed (THD) rows and context parallelism included.
"""

from __future__ import annotations

import contextlib
import inspect
import math

import torch

from rollflow.tasks.train.megatron import context_parallel as cpl

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
    from megatron.core.transformer.module import MegatronModule  # optional dependency: imported on use

    backends = tuple(sdpa_backends)
    for name in backends:
        if name not in _SDPA_BACKENDS:
            raise ValueError(f"sdpa backend {name!r}: expected one of {sorted(_SDPA_BACKENDS)}")

    class SDPACoreAttention(MegatronModule):
        """Drop-in for megatron's DotProductAttention: [s, b, np, hn] q/k/v -> [s, b, np * hn]."""

        def __init__(
            self,
            config,
            layer_number: int,
            attn_mask_type,
            attention_type: str = "self",
            attention_dropout: float | None = None,
            softmax_scale: float | None = None,
            cp_comm_type: str | None = None,
            pg_collection=None,
            **_unused,
        ):
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
                    q,
                    k,
                    v,
                    attn_mask=None,
                    dropout_p=self.dropout if self.training else 0.0,
                    is_causal=True,
                    scale=self.softmax_scale,
                )

        def _attend(self, q, k, v, mask):
            """SDPA of [b, np, sq, hn] q and [b, ng, sk, hn] k / v under `mask` (a torch attention bias)."""
            k, v = self._expand_kv(q, k, v)
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, scale=self.softmax_scale
            )

        def _cp(self):
            """(group, rank) of the context-parallel group."""
            from megatron.core import parallel_state  # optional dependency: imported on use

            group = self._cp_group or parallel_state.get_context_parallel_group()
            return group, torch.distributed.get_rank(group)

        def _context_parallel(self, query, key, value, packed_seq_params):
            """This rank's queries (its two chunks of every row, context_parallel.py) against every rank's keys
            and values, gathered in sequence order. Padded: [s/cp, b, n, hn]; packed: [t/cp, n, hn] with the
            whole sequence's row bounds in `packed_seq_params`."""
            group, rank = self._cp()
            cp = self.cp_size
            if packed_seq_params is None:
                s_local, b, heads, dim = query.shape
                _positions, order = cpl.padded_layout(s_local * cp, cp, rank)
                k, v = cpl.gather_context(torch.stack((key, value), dim=-1), order, group).unbind(-1)
                out = cpl.chunk_attention(
                    self._attend,
                    query.permute(1, 2, 0, 3),
                    k.permute(1, 2, 0, 3),
                    v.permute(1, 2, 0, 3),
                    cp=cp,
                    rank=rank,
                )
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
            if (
                self._varlen is not None
                and query.is_cuda
                and query.dtype in (torch.float16, torch.bfloat16)
                and not (self.training and self.dropout)
            ):
                out = self._varlen(
                    query,
                    key,
                    value,
                    packed_seq_params.cu_seqlens_q,
                    int(packed_seq_params.max_seqlen_q),
                    self.softmax_scale,
                )
                return out.reshape(t, heads * dim)
            bounds = getattr(packed_seq_params, "bounds", None) or packed_seq_params.cu_seqlens_q.tolist()
            pieces = []
            for a, b in zip(bounds[:-1], bounds[1:]):
                if b > a:
                    q, k, v = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
                    pieces.append(self._sdpa(q, k, v)[0].transpose(0, 1))  # [s, np, hn]
            return torch.cat(pieces, dim=0).reshape(t, heads * dim)

        def forward(
            self,
            query,
            key,
            value,
            attention_mask=None,
            attn_mask_type=None,
            attention_bias=None,
            packed_seq_params=None,
            **_unused,
        ):
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
