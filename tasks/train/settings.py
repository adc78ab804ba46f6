"""Typed, validated settings of the train side (sections of flows' RunConfig)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

Estimator = Literal["grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo"]
KLKind = Literal["k1", "k2", "k3", "low_var_kl"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class AlgoConfig(_Strict):
    """Advantage estimator, policy loss and KL, named as slime's flags."""

    advantage_estimator: Estimator = "grpo"
    normalize_advantage_std: bool = Field(True, description="GRPO: divide by the group's reward std")
    gamma: float = Field(1.0, ge=0, le=1)
    eps_clip: float = Field(0.2, gt=0)
    eps_clip_high: Optional[float] = Field(None, gt=0, description="upper clip; defaults to eps_clip")
    eps_clip_c: Optional[float] = Field(None, gt=1, description="dual-clip bound for negative advantages")
    kl_coef: float = Field(0.0, ge=0, description="KL as a reward penalty")
    kl_loss_coef: float = Field(0.0, ge=0, description="KL as a loss term")
    kl_loss_type: KLKind = "low_var_kl"
    kl_penalty_type: KLKind = "k1"
    entropy_coef: float = Field(0.0, ge=0)
    loss_reduction: Literal["token", "sample"] = "token"
    tis: Optional[Literal["tis", "icepop"]] = Field(None, description="rollout/train mismatch correction")
    tis_low: float = Field(0.5, ge=0)
    tis_high: float = Field(2.0, gt=0)

    @model_validator(mode="after")
    def _one_kl(self) -> "AlgoConfig":
        if self.kl_coef > 0 and self.kl_loss_coef > 0:
            raise ValueError(
                "algo.kl_coef and algo.kl_loss_coef are both > 0: use KL as a reward penalty (kl_coef) "
                "or as a loss (kl_loss_coef), not both; set one of them to 0"
            )
        if self.gamma != 1.0 and self.advantage_estimator != "reinforce_plus_plus":
            raise ValueError(
                f"algo.gamma={self.gamma} only applies to advantage_estimator='reinforce_plus_plus' "
                f"(got {self.advantage_estimator!r}); leave gamma at 1.0"
            )
        if self.tis_low >= self.tis_high:
            raise ValueError(f"algo.tis_low={self.tis_low} must be below algo.tis_high={self.tis_high}")
        return self

    @property
    def needs_ref(self) -> bool:
        return self.kl_coef > 0 or self.kl_loss_coef > 0


class MegatronSettings(_Strict):
    """Knobs of the `megatron` backend (tasks/train/megatron_backend.py); ignored by `torch`."""

    layer_spec: Literal["auto", "te", "sdpa", "local"] = Field(
        "auto", description="auto: te when transformer-engine imports, else sdpa (local spec + torch SDPA attention)")
    sdpa_backends: tuple[Literal["flash", "cudnn", "efficient", "math"], ...] = Field(
        (), description="pin torch SDPA kernels, in priority order (empty: torch picks)")
    attention_backend: Literal["auto", "flash", "fused", "unfused", "local"] = Field(
        "auto", description="Megatron's AttnBackend for the te spec")
    optimizer: Literal["auto", "megatron", "torch"] = Field(
        "auto", description="megatron: Megatron DDP + get_megatron_optimizer (CUDA); torch: AdamW on fp32 master "
                            "weights; auto: megatron on CUDA, torch on CPU")
    fusions: Literal["auto", "on", "off"] = Field(
        "auto", description="Megatron's bias-SwiGLU / bias-dropout-add fusions (torch.compile'd); auto: on on CUDA")
    make_vocab_size_divisible_by: int = Field(128, ge=1)
    log_prob_impl: Literal["auto", "chunked", "compiled"] = Field(
        "auto", description="log-prob / entropy kernel: eager row chunks, or torch.compile'd; auto: compiled on CUDA")
    log_prob_chunk: int = Field(2048, ge=1, description="rows per chunk of the chunked log-prob kernel")
    rope_fusion: Literal["auto", "none", "compiled"] = Field(
        "auto", description="compiled: a torch.compile'd RoPE through Megatron's apply_rope_fusion hook (TE's fused "
                            "RoPE when TE is installed); auto: compiled on CUDA")

    def resolved(self, device_type: str) -> "MegatronSettings":
        """`auto` made concrete: the torch.compile'd kernels on CUDA (measured on the H200), eager on CPU."""
        cuda = device_type == "cuda"
        return self.model_copy(update=dict(
            fusions=("on" if cuda else "off") if self.fusions == "auto" else self.fusions,
            log_prob_impl=("compiled" if cuda else "chunked") if self.log_prob_impl == "auto" else self.log_prob_impl,
            rope_fusion=("compiled" if cuda else "none") if self.rope_fusion == "auto" else self.rope_fusion,
        ))
    transformer_config: dict[str, Any] = Field(
        default_factory=dict, description="extra TransformerConfig fields, passed through")


class OptimConfig(_Strict):
    backend: Literal["torch", "megatron"] = "torch"
    lr: float = Field(2e-4, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    grad_clip: float = Field(1.0, gt=0)
    num_steps_per_rollout: int = Field(8, ge=1, description="optimizer steps (mini-batches) per rollout")
    micro_batch_size: int = Field(256, ge=1)
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    device: str = "cpu"
    threads: int = Field(1, ge=1, description="torch threads of the trainer (fixed so numerics repeat)")
    compute_ref_log_probs: bool = Field(True, description="also needed by the alignment checks")
    seed: int = 1234
    megatron: MegatronSettings = Field(default_factory=MegatronSettings)
