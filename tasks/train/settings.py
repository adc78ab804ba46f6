"""Typed, validated settings of the train side (sections of flows' RunConfig)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

Estimator = Literal["grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo", "ppo"]
KLKind = Literal["k1", "k2", "k3", "low_var_kl"]
LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
ISLevel = Literal["token", "sequence", "geometric"]

# GSPO's own settings (Zheng et al. 2025, "Group Sequence Policy Optimization": left / right clipping ranges
# 3e-4 / 4e-4 of the length-normalized sequence ratio, the loss a mean over the group's sequences, which
# seq-mean-token-mean equals for the sequence ratio). GRPO's 0.2 never clips at the sequence ratio's scale, so
# an unset field takes these.
GSPO_DEFAULTS: dict[str, Any] = {"eps_clip": 3e-4, "eps_clip_high": 4e-4, "loss_agg_mode": "seq-mean-token-mean"}


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
    loss_agg_mode: LossAggMode = Field(
        "token-mean",
        description="how per-token losses become one number: token-mean (verl's default; slime's "
        "--calculate-per-token-loss), seq-mean-token-mean (slime's default), seq-mean-token-sum, "
        "seq-mean-token-sum-norm (Dr. GRPO: token sums over a constant, loss_norm_constant)",
    )
    loss_norm_constant: Optional[int] = Field(
        None,
        ge=1,
        description="seq-mean-token-sum-norm's constant divisor; run configs fill in rollout.max_new_tokens when unset",
    )
    # Train/rollout mismatch correction (slime's --use-tis family; names and defaults as slime's).
    routing_replay: bool = Field(
        False,
        description="MoE models (R3): the engine records each token's top-k experts per layer and the trainer "
        "replays them in every forward that scores rollout tokens (old, ref, train); hf engine, torch backend",
    )
    use_rollout_logprobs: bool = Field(
        False,
        description="old log-probs = the engine's rollout log-probs (no trainer recompute; slime's "
        "--use-rollout-logprobs); excludes use_tis",
    )
    use_tis: Optional[bool] = Field(
        None,
        description="weight the policy loss by train/rollout importance ratios; unset: on when the run trains "
        "off-policy (pipeline.max_staleness >= 1), else off (the run's config decides and says so)",
    )
    tis_level: ISLevel = Field("token", description="token ratio, sequence (product) or geometric (mean) ratio")
    tis_mode: Literal["truncate", "clip", "mask"] = Field(
        "truncate",
        description="truncate: min(w, upper) (TIS); clip: clamp to [lower, upper]; mask: 0 outside "
        "[lower, upper] (icepop / MIS)",
    )
    tis_lower_bound: Optional[float] = Field(
        None, ge=0, description="clip/mask lower bound; unset: 1 / tis_upper_bound (slime)"
    )
    tis_upper_bound: float = Field(2.0, gt=0, description="slime's --tis-clip default")
    tis_batch_normalize: bool = Field(False, description="rescale the weights to mean 1 over the rollout")
    use_rs: bool = Field(
        False,
        description="rejection sampling: drop tokens/samples whose ratio is outside [rs_lower_bound, rs_upper_bound]",
    )
    rs_level: ISLevel = "token"
    rs_lower_bound: Optional[float] = Field(None, ge=0, description="unset: the TIS lower bound")
    rs_upper_bound: Optional[float] = Field(None, gt=0, description="unset: tis_upper_bound")
    rs_veto_threshold: Optional[float] = Field(
        None, gt=0, lt=1, description="drop a whole sample if any token's ratio is below this (typical 1e-4)"
    )
    max_consecutive_skipped_steps: int = Field(
        3, ge=1, description="non-finite loss or grad norm skips the optimizer step; this many in a row fail the run"
    )
    # ppo only: a critic actor + GAE (tasks/train/critic.py); names as slime's --lambd / --value-clip / --critic-lr.
    lambd: float = Field(1.0, ge=0, le=1, description="ppo: GAE lambda (slime's --lambd, verl's algorithm.lam)")
    value_clip: float = Field(
        0.2,
        gt=0,
        description="ppo: the critic's value clip around its old values (slime's "
        "--value-clip; verl's critic.cliprange_value defaults to 0.5)",
    )
    critic_lr: float = Field(
        1e-5,
        ge=0,
        description="ppo: the critic's AdamW learning rate (slime's --critic-lr); "
        "its other optimizer settings are train.*",
    )

    _implied: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _gspo_defaults(cls, data: Any, handler: Any) -> "AlgoConfig":
        """advantage_estimator='gspo' takes GSPO_DEFAULTS for the fields the input leaves unset (the same
        set as pydantic's model_fields_set); `implied` says which were taken."""
        taken: dict[str, Any] = {}
        if isinstance(data, dict) and data.get("advantage_estimator") == "gspo":
            taken = {k: v for k, v in GSPO_DEFAULTS.items() if k not in data}
            if "eps_clip" in data:
                # eps_clip_high unset means "= eps_clip" (a symmetric range the user chose), not GSPO's 4e-4
                taken.pop("eps_clip_high", None)
            data = {**data, **taken}
        cfg = handler(data)
        if taken:
            cfg._implied = [
                "algo.advantage_estimator='gspo': took GSPO's defaults (Zheng et al. 2025) "
                + ", ".join(f"algo.{k}={v!r}" for k, v in taken.items())
                + "; set them explicitly to override"
            ]
        return cfg

    @property
    def implied(self) -> list[str]:
        """Defaults validation took on the user's behalf (RunConfig reports them in its notices)."""
        return list(self._implied)

    @model_validator(mode="after")
    def _one_kl(self) -> "AlgoConfig":
        if self.kl_coef > 0 and self.kl_loss_coef > 0:
            raise ValueError(
                "algo.kl_coef and algo.kl_loss_coef are both > 0: use KL as a reward penalty (kl_coef) "
                "or as a loss (kl_loss_coef), not both; set one of them to 0"
            )
        if self.gamma != 1.0 and self.advantage_estimator not in ("reinforce_plus_plus", "ppo"):
            raise ValueError(
                f"algo.gamma={self.gamma} only applies to advantage_estimator='reinforce_plus_plus' or 'ppo' "
                f"(got {self.advantage_estimator!r}); leave gamma at 1.0"
            )
        if self.advantage_estimator == "ppo" and self.kl_coef > 0:
            # The critic computes GAE from the scalar rewards alone: a per-token KL penalty would need the
            # policy's and the reference's log-probs inside the critic actor.
            raise ValueError(
                f"algo.kl_coef={self.kl_coef} (KL as a reward penalty) is not supported with "
                "advantage_estimator='ppo' (the critic's GAE sees the scalar rewards only); use "
                "algo.kl_loss_coef instead, or set algo.kl_coef=0"
            )
        if self.lambd != 1.0 and self.advantage_estimator != "ppo":
            raise ValueError(
                f"algo.lambd={self.lambd} only applies to advantage_estimator='ppo' (GAE); leave lambd at 1.0"
            )
        if self.use_rollout_logprobs and self.use_tis:
            raise ValueError(
                "algo.use_rollout_logprobs and algo.use_tis are both on: the ratio old/rollout is then "
                "1 by construction; turn one of them off"
            )
        low, high = self.tis_bounds
        if self.use_tis and self.tis_mode != "truncate" and not low < high:
            raise ValueError(f"algo.tis_lower_bound={low} must be below algo.tis_upper_bound={high}")
        rs_low, rs_high = self.rs_bounds
        if self.use_rs and not rs_low < rs_high:
            raise ValueError(f"algo.rs_lower_bound={rs_low} must be below algo.rs_upper_bound={rs_high}")
        return self

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict):
            moved = {
                "loss_reduction": "loss_agg_mode ('token' -> 'token-mean', 'sample' -> 'seq-mean-token-mean')",
                "tis": "use_tis=true with tis_mode ('tis' -> 'clip', 'icepop' -> 'mask')",
                "tis_low": "tis_lower_bound",
                "tis_high": "tis_upper_bound",
            }
            for old, new in moved.items():
                if old in data:
                    raise ValueError(f"algo.{old} was renamed: use algo.{new}")
        return data

    @property
    def tis_bounds(self) -> tuple[float, float]:
        high = self.tis_upper_bound
        return (1.0 / high if self.tis_lower_bound is None else self.tis_lower_bound), high

    @property
    def rs_bounds(self) -> tuple[float, float]:
        low, high = self.tis_bounds
        return (
            low if self.rs_lower_bound is None else self.rs_lower_bound,
            high if self.rs_upper_bound is None else self.rs_upper_bound,
        )

    @property
    def needs_ref(self) -> bool:
        return self.kl_coef > 0 or self.kl_loss_coef > 0


class MegatronSettings(_Strict):
    """Knobs of the `megatron` backend (tasks/train/megatron/); ignored by `torch`."""

    layer_spec: Literal["auto", "te", "sdpa", "local"] = Field(
        "auto", description="auto: te when transformer-engine imports, else sdpa (local spec + torch SDPA attention)"
    )
    sdpa_backends: tuple[Literal["flash", "cudnn", "efficient", "math"], ...] = Field(
        (), description="pin torch SDPA kernels, in priority order (empty: torch picks)"
    )
    attention_backend: Literal["auto", "flash", "fused", "unfused", "local"] = Field(
        "auto", description="Megatron's AttnBackend for the te spec"
    )
    optimizer: Literal["auto", "megatron", "torch"] = Field(
        "auto",
        description="megatron: Megatron DDP + get_megatron_optimizer (CUDA); torch: AdamW on fp32 master "
        "weights; auto: megatron on CUDA, torch on CPU",
    )
    fusions: Literal["auto", "on", "off"] = Field(
        "auto", description="Megatron's bias-SwiGLU / bias-dropout-add fusions (torch.compile'd); auto: on on CUDA"
    )
    make_vocab_size_divisible_by: int = Field(128, ge=1)
    log_prob_impl: Literal["auto", "chunked", "compiled"] = Field(
        "auto", description="log-prob / entropy kernel: eager row chunks, or torch.compile'd; auto: compiled on CUDA"
    )
    log_prob_chunk: int = Field(2048, ge=1, description="rows per chunk of the chunked log-prob kernel")
    rope_fusion: Literal["auto", "none", "compiled"] = Field(
        "auto",
        description="compiled: a torch.compile'd RoPE through Megatron's apply_rope_fusion hook (TE's fused "
        "RoPE when TE is installed); auto: compiled on CUDA",
    )

    def resolved(self, device_type: str) -> "MegatronSettings":
        """`auto` made concrete: the torch.compile'd kernels on CUDA (measured on the H200), eager on CPU."""
        cuda = device_type == "cuda"
        return self.model_copy(
            update=dict(
                fusions=("on" if cuda else "off") if self.fusions == "auto" else self.fusions,
                log_prob_impl=("compiled" if cuda else "chunked")
                if self.log_prob_impl == "auto"
                else self.log_prob_impl,
                rope_fusion=("compiled" if cuda else "none") if self.rope_fusion == "auto" else self.rope_fusion,
            )
        )

    transformer_config: dict[str, Any] = Field(
        default_factory=dict, description="extra TransformerConfig fields, passed through"
    )
    # Parallel layout: data parallel = world / (tp * pp * cp) (`data_parallel_size`).
    tp: int = Field(1, ge=1, description="tensor-parallel size (divides the KV heads and the FFN width)")
    pp: int = Field(1, ge=1, description="pipeline-parallel size (stages; divides the layers)")
    cp: int = Field(1, ge=1, description="context-parallel size: each sequence split over cp ranks (sdpa or te spec)")
    vpp: Optional[int] = Field(None, ge=2, description="virtual pipeline stages per rank (interleaved 1F1B); pp > 1")
    sequence_parallel: bool = Field(False, description="shard norms / dropout activations over the TP group; tp > 1")
    recompute_granularity: Optional[Literal["full", "selective"]] = Field(
        None, description="activation recompute (Megatron's); takes effect because training runs in train mode"
    )
    recompute_method: Optional[Literal["uniform", "block"]] = Field(
        None, description="full recompute only: uniform (groups of recompute_num_layers) or block (first N layers)"
    )
    recompute_num_layers: Optional[int] = Field(None, ge=1, description="full recompute only")
    use_distributed_optimizer: bool = Field(False, description="shard optimizer state over data parallel (ZeRO-1)")
    overlap_grad_reduce: bool = Field(False, description="overlap the DP grad reduce with backward (CUDA)")
    overlap_param_gather: bool = Field(False, description="overlap the param all-gather (distributed optimizer)")
    lr_warmup_steps: int = Field(0, ge=0, description="linear warmup optimizer steps (Megatron's scheduler)")
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    lr_decay_steps: Optional[int] = Field(None, ge=1, description="steps of decay after warmup (non-constant styles)")
    min_lr: float = Field(0.0, ge=0, description="the LR the decay ends at")
    max_tokens_per_gpu: Optional[int] = Field(
        None,
        ge=1,
        description="token budget of a micro-batch (rows x its own padded width; packed: the sum of "
        "its rows' lengths) instead of micro_batch_size rows; optimizer=megatron, pp = 1",
    )
    packing: Literal["off", "thd"] = Field(
        "off",
        description="thd: a micro-batch's rows packed end to end (PackedSeqParams, no padding to the "
        "longest row); sdpa or te layer spec, optimizer=megatron. off: right-padded rows",
    )
    pack_multiple: int = Field(
        1,
        ge=1,
        description="packing='thd': each packed micro-batch's length rounded up to a multiple of this "
        "(fewer distinct shapes for compiled kernels; the padding is its own segment)",
    )

    @model_validator(mode="after")
    def _parallel_layout(self) -> "MegatronSettings":
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("train.megatron.sequence_parallel=true needs train.megatron.tp > 1; set it false at tp=1")
        if self.vpp is not None and self.pp == 1:
            raise ValueError(f"train.megatron.vpp={self.vpp} needs train.megatron.pp > 1; unset vpp")
        if self.cp > 1 and self.layer_spec == "local":
            raise ValueError(
                f"train.megatron.cp={self.cp} needs an attention that sees the other cp ranks' keys: "
                "layer_spec 'sdpa' (all-gathered keys / values) or 'te'; Megatron's local attention "
                "refuses it. Set layer_spec=sdpa or cp=1"
            )
        if self.recompute_granularity != "full" and (self.recompute_method or self.recompute_num_layers):
            raise ValueError(
                "train.megatron.recompute_method / recompute_num_layers apply to "
                "recompute_granularity='full' only; set recompute_granularity=full or unset them"
            )
        if self.recompute_granularity == "full" and not (self.recompute_method and self.recompute_num_layers):
            raise ValueError(
                "train.megatron.recompute_granularity='full' needs recompute_method (uniform | block) and "
                "recompute_num_layers"
            )
        if self.max_tokens_per_gpu is not None and self.pp > 1:
            raise ValueError(
                "train.megatron.max_tokens_per_gpu needs pp = 1 (pipeline stages exchange fixed-shape "
                "activations); use micro_batch_size with pp > 1, or unset max_tokens_per_gpu"
            )
        if self.packing == "thd" and self.layer_spec == "local":
            raise ValueError(
                "train.megatron.packing='thd' needs an attention that reads PackedSeqParams: "
                "layer_spec 'sdpa' (per-row torch SDPA) or 'te'; Megatron's local attention cannot. "
                "Set layer_spec=sdpa or packing=off"
            )
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("train.megatron.overlap_param_gather needs use_distributed_optimizer=true")
        if self.lr_decay_style != "constant" and self.lr_decay_steps is None:
            raise ValueError(f"train.megatron.lr_decay_style={self.lr_decay_style!r} needs lr_decay_steps")
        return self

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    def data_parallel_size(self, world_size: int) -> int:
        """world / (tp * pp * cp), or one clear error naming the fields."""
        if world_size % self.model_parallel_size:
            raise ValueError(
                f"trainer world size {world_size} is not divisible by train.megatron.tp * pp * cp = "
                f"{self.tp} * {self.pp} * {self.cp}; use a world size that is a multiple of "
                f"{self.model_parallel_size}"
            )
        return world_size // self.model_parallel_size

    def check_model(self, num_layers: int, num_kv_heads: int) -> None:
        """The layout against the model's shape (before any rank builds anything)."""
        stages = self.pp * (self.vpp or 1)
        if num_layers % stages:
            raise ValueError(
                f"num_hidden_layers={num_layers} is not divisible by train.megatron.pp * vpp = {stages}; "
                "choose pp / vpp that divide the layer count"
            )
        if num_kv_heads % self.tp:
            raise ValueError(
                f"num_key_value_heads={num_kv_heads} is not divisible by train.megatron.tp={self.tp}; "
                "choose a tp that divides the KV heads"
            )


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
    check_memory_fit: bool = Field(
        True,
        description="refuse before loading when the trainer's state (weights, grads, optimizer) cannot fit the GPU, "
        "or with colocated offload the node's host memory (a lower bound: tasks/train/memory_fit.py)",
    )
    megatron: MegatronSettings = Field(default_factory=MegatronSettings)


LORA_BACKEND_REFUSED = (
    "model.lora needs train.backend=torch (peft): megatron-core's LoRA is not wired into the megatron backend "
    "(its model build, distributed checkpoints and HF weight export); set train.backend=torch or drop model.lora"
)

# The attention and MLP projections of Llama / Qwen2 / Qwen3 (and the built-in addition model, a Qwen2).
LORA_DEFAULT_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSettings(_Strict):
    """Low-rank adapters on the policy (`model.lora`; torch backend, peft): W' = W + (alpha / rank) * B @ A,
    only A and B train, B starts at zero so the starting policy is the base model."""

    rank: int = Field(8, ge=1, description="adapter rank r")
    alpha: float = Field(16.0, gt=0, description="scale numerator: the update is (alpha / rank) * B @ A")
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="dropout on the adapter's input in the gradient forward only (scoring forwards run "
        "without it); > 0 makes the first step's ppo_kl nonzero once B moves",
    )
    target_modules: tuple[str, ...] = Field(
        LORA_DEFAULT_TARGETS, min_length=1, description="module names (last name part) that get adapters"
    )

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank
