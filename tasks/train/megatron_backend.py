"""The `megatron` TrainBackend: a megatron-core GPTModel for the Llama / Qwen2 family, one process.

Behind the same protocol as `torch_backend.TorchBackend` (tasks/train/step.py: TrainBackend): the same
TrainBatch layout, the same `micro_batch_objective`, the same `train/*` metric names. Weights come in
and go out with HF names through `rollflow.tasks.sync.megatron_names`, so the engine sync and the parity check
(`rollflow.tasks.sync.parity.compare`) are unchanged.

megatron-core is imported lazily: this module imports on a CPU box without it, and building the backend
there raises `MegatronMissing` with the install line. Target: tp = pp = 1 on one GPU (the converter has
the tp/pp paths for later).

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
from typing import Any

import torch

from rollflow.tasks.model.dtypes import DTYPES
from rollflow.tasks.sync import megatron_names as mn
from rollflow.tasks.train.batch import TrainBatch
from rollflow.tasks.train.fused_ops import install_rope_fusion, token_log_probs
from rollflow.tasks.train.objective import Denominators, micro_batch_objective, minibatch_steps
from rollflow.tasks.train.torch_backend import split_rows
from rollflow.tasks.train.settings import AlgoConfig, MegatronSettings, OptimConfig

MISSING_MESSAGE = ("train.backend='megatron' needs megatron-core: pip install 'rollflow[megatron]' "
                   "(Python >= 3.12 for megatron-core >= 0.17; 0.16.1 on 3.11)")


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


def init_parallel_state(device: torch.device, seed: int, *, tp_size: int = 1, pp_size: int = 1) -> None:
    """One-process torch.distributed + Megatron's model-parallel groups (idempotent)."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if device.type == "cuda":
        torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, rank=int(os.environ.get("RANK", 0)),
                                world_size=int(os.environ.get("WORLD_SIZE", 1)))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size,
                                                 pipeline_model_parallel_size=pp_size)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


# ------------------------------------------------------------------------------- SDPA core attention

_SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}


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
            if getattr(config, "context_parallel_size", 1) != 1:
                raise ValueError("SDPACoreAttention does not support context parallelism")
            if getattr(config, "softmax_type", "vanilla") != "vanilla":
                raise ValueError("SDPACoreAttention supports only softmax_type='vanilla'")
            self.attn_mask_type = attn_mask_type
            self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
            self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
            self._kernel = None
            if backends:
                from torch.nn.attention import SDPBackend

                self._kernel = [getattr(SDPBackend, _SDPA_BACKENDS[n]) for n in backends]

        def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **_unused):
            if packed_seq_params is not None:
                raise ValueError("SDPACoreAttention: packed sequences are not supported")
            if attention_bias is not None:
                raise ValueError("SDPACoreAttention: attention_bias is not supported")
            sq, b, heads, dim = query.shape
            q = query.permute(1, 2, 0, 3)  # [b, np, s, hn]
            k = key.permute(1, 2, 0, 3)
            v = value.permute(1, 2, 0, 3)
            if k.shape[1] != heads:  # GQA: repeat the kv heads (portable across SDPA kernels)
                k = k.repeat_interleave(heads // k.shape[1], dim=1)
                v = v.repeat_interleave(heads // v.shape[1], dim=1)
            ctx = contextlib.nullcontext()
            if self._kernel is not None and q.is_cuda:
                from torch.nn.attention import sdpa_kernel

                ctx = sdpa_kernel(self._kernel, set_priority=True)
            with ctx:
                out = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0.0,
                    is_causal=True, scale=self.softmax_scale)
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
    if settings.rope_fusion == "compiled":
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
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=dtype == torch.bfloat16,
        fp16=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        sequence_parallel=False,
        use_cpu_initialization=device.type != "cuda",
        perform_initialization=random_init,
        # Fusions that need TE or apex stay off; the torch.compile'd ones are opt-in (settings.fusions).
        gradient_accumulation_fusion=False,
        apply_rope_fusion=settings.rope_fusion == "compiled",
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_activation_fusion=settings.fusions == "on",
        bias_dropout_fusion=settings.fusions == "on",
        attention_softmax_in_fp32=True,
        attention_backend=AttnBackend[settings.attention_backend] if spec == "te" else AttnBackend.local,
    )
    kwargs.update(settings.transformer_config)
    return TransformerConfig(**kwargs), spec


def build_layer_spec(spec: str, settings: MegatronSettings):
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if spec == "te":
        return specs.get_gpt_layer_with_transformer_engine_spec()
    layer = specs.get_gpt_layer_local_spec(normalization="RMSNorm")  # a fresh spec object per call
    if spec == "sdpa":
        layer.submodules.self_attention.submodules.core_attention = make_sdpa_core_attention(settings.sdpa_backends)
    elif spec != "local":
        raise ValueError(f"train.megatron.layer_spec={spec!r}: expected auto, te, sdpa or local")
    return layer


def build_gpt_model(hf_config, settings: MegatronSettings, *, dtype: torch.dtype, device: torch.device,
                    random_init: bool = False):
    """A megatron-core GPTModel for an HF Llama / Qwen2 config (tp = pp = 1); returns (model, layout)."""
    from megatron.core.models.gpt import GPTModel

    config, spec = build_transformer_config(hf_config, settings, dtype=dtype, device=device, random_init=random_init)
    layout = mn.MegatronLayout.from_hf_config(hf_config, spec="te" if spec == "te" else "local",
                                              make_vocab_size_divisible_by=settings.make_vocab_size_divisible_by)
    model = GPTModel(
        config=config,
        transformer_layer_spec=build_layer_spec(spec, settings),
        vocab_size=layout.padded_vocab_size,
        max_sequence_length=int(getattr(hf_config, "max_position_embeddings", 4096)),
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=layout.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        **_rope(hf_config),
    )
    # Norm weights are created in fp32; cast everything, as Megatron's Float16Module does (rotary inv_freq is a
    # plain attribute, not a buffer, so it stays fp32).
    model = model.to(device=device, dtype=dtype)
    return model, layout, spec


def load_hf_weights(model: torch.nn.Module, hf_state: dict[str, torch.Tensor], layout: mn.MegatronLayout) -> None:
    """Copy an HF state dict into a (tp = pp = 1) Megatron model through the converter; strict on names."""
    converted = mn.hf_to_megatron(hf_state, layout)
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


def export_hf_weights(model: torch.nn.Module, layout: mn.MegatronLayout) -> dict[str, torch.Tensor]:
    state = {k: v.detach() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    return {k: v.cpu().clone() for k, v in mn.megatron_to_hf(state, layout).items()}


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


def _check_right_padded(mask: torch.Tensor) -> None:
    lengths = mask.sum(dim=1, keepdim=True)
    expected = (torch.arange(mask.shape[1]).unsqueeze(0) < lengths).to(mask.dtype)
    if not torch.equal(mask.cpu(), expected):
        raise ValueError("the megatron backend needs right-padded rows (tokens first, padding last): Megatron's "
                         "rotary positions are 0..L-1 and its causal mask has no padding term")


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
    name = "megatron"

    def __init__(self, hf_config, hf_state: dict[str, torch.Tensor] | None, optim: OptimConfig, *,
                 temperature: float = 1.0, keep_ref: bool = True):
        require_megatron()
        torch.set_num_threads(optim.threads)
        torch.manual_seed(optim.seed)
        self.optim_cfg = optim
        self.device = torch.device(optim.device)
        self.settings = optim.megatron.resolved(self.device.type)
        self.temperature = temperature if temperature > 0 else 1.0
        self.dtype = DTYPES[optim.dtype]
        init_parallel_state(self.device, optim.seed)
        random_init = hf_state is None
        if self.device.type != "cuda" and resolve_layer_spec(self.settings.layer_spec) != "sdpa":
            raise ValueError("on CPU the megatron backend runs only train.megatron.layer_spec='sdpa' (the local "
                             "spec's attention forks Megatron's CUDA RNG tracker)")
        self.model, self.layout, self.layer_spec = build_gpt_model(hf_config, self.settings, dtype=self.dtype,
                                                                   device=self.device, random_init=random_init)
        if hf_state is not None:
            load_hf_weights(self.model, hf_state, self.layout)
        # The reference is the starting policy, frozen; kept before any checkpoint is loaded.
        self.ref_model = None
        if keep_ref:  # a second model, not a deepcopy: Megatron modules hold process groups
            self.ref_model, _, _ = build_gpt_model(hf_config, self.settings, dtype=self.dtype, device=self.device,
                                                   random_init=False)
            self.ref_model.load_state_dict(self.model.state_dict())
            self.ref_model.eval().requires_grad_(False)
        self.optimizer_kind = self.settings.optimizer
        if self.optimizer_kind == "auto":
            self.optimizer_kind = "megatron" if self.device.type == "cuda" else "torch"
        self._build_optimizer()

    # -- optimizer ---------------------------------------------------------------------------------

    def _build_optimizer(self) -> None:
        optim = self.optim_cfg
        if self.optimizer_kind == "torch":
            self.ddp = None
            self.train_model = self.model
            self.optimizer = _MasterAdamW([p for p in self.model.parameters() if p.requires_grad], optim)
            return
        if self.optimizer_kind != "megatron":
            raise ValueError(f"train.megatron.optimizer={self.optimizer_kind!r}: expected auto, megatron or torch")
        if self.device.type != "cuda":
            raise ValueError("train.megatron.optimizer='megatron' needs CUDA (Megatron's optimizer hard-codes CUDA "
                             "tensors); use optimizer='torch' on CPU")
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=False)
        self.ddp = DistributedDataParallel(config=self.model.config, ddp_config=ddp_config, module=self.model)
        self.train_model = self.ddp
        opt_config = OptimizerConfig(
            optimizer="adam", lr=optim.lr, min_lr=optim.lr, weight_decay=optim.weight_decay,
            adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=1e-8, clip_grad=optim.grad_clip,
            bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype, use_distributed_optimizer=False,
        )
        self.optimizer = get_megatron_optimizer(opt_config, [self.ddp])
        for group in self.optimizer.param_groups:  # no LR scheduler: a constant LR, as the torch backend
            group["lr"] = optim.lr

    def _zero_grad(self) -> None:
        if self.ddp is not None:
            self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _optimizer_step(self) -> float:
        if self.ddp is None:
            return self.optimizer.step()
        self.ddp.finish_grad_sync()
        # Megatron checks for inf only under fp16 loss scaling; bf16/fp32 would clip by a NaN norm and
        # write NaN weights, so look at the reduced grads first.
        grads = [p.main_grad for p in self.model.parameters() if getattr(p, "main_grad", None) is not None]
        if grads and not bool(torch.stack([g.float().norm() for g in grads]).isfinite().all()):
            return float("nan")
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise FloatingPointError("Megatron optimizer step was skipped (inf/nan gradients)")
        return float(grad_norm)

    # -- forward -------------------------------------------------------------------------------------

    def _log_probs(self, model, micro: TrainBatch, *, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced log-prob (and entropy) of every next token, target aligned [B, L-1], fp32, on device."""
        tokens = micro.tokens.to(self.device, non_blocking=True)
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

    @torch.no_grad()
    def compute_log_probs(self, batch: TrainBatch, which: str = "policy") -> torch.Tensor:
        model = self.model if which == "policy" else self.ref_model
        if model is None:
            raise RuntimeError("reference log-probs requested but the trainer was built without a reference model")
        _check_right_padded(batch.attention_mask)
        was_training = model.training
        model.eval()
        # Same micro-batch split as the training forward: numerics then match bit for bit.
        parts = [self._log_probs(model, mb, entropy_grad=False)[0].cpu()
                 for mb in split_rows(batch, self.optim_cfg.micro_batch_size)]
        model.train(was_training)
        return torch.cat(parts, dim=0)

    def micro_step(self, micro: TrainBatch, algo: AlgoConfig, denom: Denominators) -> dict[str, float]:
        """Forward, objective and backward of one micro-batch (grads accumulate)."""
        log_probs, entropy = self._log_probs(self.train_model, micro, entropy_grad=algo.entropy_coef > 0)
        loss, stats = micro_batch_objective(log_probs, entropy, batch_to(micro, self.device), algo, denom)
        loss.backward()
        return stats

    def train(self, batch: TrainBatch, algo: AlgoConfig, on_step=None) -> dict[str, float]:
        """`num_steps_per_rollout` optimizer steps over consecutive mini-batches; mean of step stats
        (`on_step` gets each step's own: objective.minibatch_steps)."""
        _check_right_padded(batch.attention_mask)
        # eval(): no dropout, so the training forward is the same function as the scoring forward.
        self.model.eval()
        return minibatch_steps(batch, self.optim_cfg.num_steps_per_rollout, self.optim_cfg.micro_batch_size,
                               zero_grad=self._zero_grad,
                               micro_step=lambda micro, denom: self.micro_step(micro, algo, denom),
                               optimizer_step=self._optimizer_step, on_step=on_step)

    # -- weights and checkpoints -----------------------------------------------------------------------

    def named_weights(self) -> dict[str, torch.Tensor]:
        """HF-named tensors (vocab padding removed), for the engine sync and `rollflow.tasks.sync.parity`."""
        return export_hf_weights(self.model, self.layout)

    def checkpoint_bytes(self) -> bytes:
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


def build_megatron_backend(model_dir, optim: OptimConfig, *, temperature: float) -> MegatronBackend:
    """From a local HF model directory (config.json + safetensors)."""
    require_megatron()
    from rollflow.tasks.model.tiny import load_model

    hf_model = load_model(model_dir)
    state = {k: v.detach() for k, v in hf_model.state_dict().items()}
    backend = MegatronBackend(hf_model.config, state, optim, temperature=temperature)
    del hf_model, state
    return backend
