"""HF <-> Megatron-core GPT weight conversion for the Llama / Qwen2 family (pure torch, no megatron import).

Megatron-core GPT naming (tp=1, pp=1, "global" layout):

    embedding.word_embeddings.weight                    [V_pad, h]  (vocab padded, see `padded_vocab_size`)
    decoder.layers.{i}.self_attention.linear_qkv.weight [ng * (q_per_g + 2) * d, h]  fused, grouped by query group
    decoder.layers.{i}.self_attention.linear_qkv.bias   (Qwen2 only; same layout)
    decoder.layers.{i}.self_attention.linear_proj.weight
    decoder.layers.{i}.mlp.linear_fc1.weight            [2 * ffn, h]  = cat(gate, up)
    decoder.layers.{i}.mlp.linear_fc2.weight
    decoder.layers.{i}.input_layernorm.weight           local spec; TE spec: ...linear_qkv.layer_norm_weight
    decoder.layers.{i}.pre_mlp_layernorm.weight         local spec; TE spec: ...mlp.linear_fc1.layer_norm_weight
    decoder.final_layernorm.weight
    output_layer.weight                                 [V_pad, h]  (absent when embeddings are tied, pp=1)

The fused QKV rows are laid out group by group: for each of the ng query groups, its q_per_g query heads,
then its key head, then its value head (d rows each). Splitting that tensor along dim 0 into tp equal parts
therefore hands each rank whole query groups, which is what Megatron's column-parallel QKV expects.
fc1 is [gate; up]: a tp rank holds cat(gate_r, up_r), so gate and up are split separately.

Pipeline stages name their layers locally 0..n-1; stage s holds global layers offset(s)..offset(s)+n-1.
`merge_pipeline` / `export_stage_to_hf` add the offset back. Forgetting it exports stage 1's first layer as
layer 0 and overwrites the engine's real layer 0: `rollflow.tasks.sync.parity.compare` names that tensor.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Literal, Mapping, Sequence

import torch

Spec = Literal["local", "te"]
StateDict = dict[str, torch.Tensor]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# Per-layer Megatron suffixes, by role. Norm names differ between the local and the TE layer spec.
_NORM_NAMES = {
    "local": ("input_layernorm.weight", "pre_mlp_layernorm.weight"),
    "te": ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"),
}
QKV_W = "self_attention.linear_qkv.weight"
QKV_B = "self_attention.linear_qkv.bias"
PROJ_W = "self_attention.linear_proj.weight"
FC1_W = "mlp.linear_fc1.weight"
FC2_W = "mlp.linear_fc2.weight"
Q_NORM = "self_attention.q_layernorm.weight"  # Qwen3's per-head RMSNorm of q / k (qk_layernorm)
K_NORM = "self_attention.k_layernorm.weight"
EMBED = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"


class ConversionError(ValueError):
    pass


def sliding_window(config) -> int | None:
    """The sliding-window width an HF config really applies, or None (full causal attention)."""
    if getattr(config, "model_type", "") in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        return None  # Qwen configs carry a sliding_window value that only use_sliding_window turns on
    window = getattr(config, "sliding_window", None)
    max_positions = getattr(config, "max_position_embeddings", None)
    if window is None or (max_positions is not None and window >= max_positions):
        return None
    return int(window)


def padded_vocab_size(vocab_size: int, *, divisible_by: int = 128, tp_size: int = 1) -> int:
    """Megatron pads the vocabulary to a multiple of divisible_by * tp_size."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(config, "rope_theta", 10000.0))


@dataclasses.dataclass(frozen=True)
class MegatronLayout:
    """Shapes and parallel layout needed to map tensors; built from an HF config by `from_hf_config`."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    padded_vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    spec: Spec = "local"
    qk_layernorm: bool = False
    tp_size: int = 1
    pp_size: int = 1
    layers_per_stage: tuple[int, ...] | None = None  # None: num_layers / pp_size each

    def __post_init__(self):
        if self.spec not in _NORM_NAMES:
            raise ConversionError(f"spec={self.spec!r}: expected 'local' or 'te'")
        if self.num_attention_heads % self.num_query_groups:
            raise ConversionError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_query_groups={self.num_query_groups}"
            )
        if self.num_query_groups % self.tp_size:
            raise ConversionError(
                f"num_query_groups={self.num_query_groups} (KV heads) is not divisible by "
                f"tp_size={self.tp_size}; Megatron splits QKV by whole query groups"
            )
        if self.ffn_hidden_size % self.tp_size:
            raise ConversionError(f"ffn_hidden_size={self.ffn_hidden_size} is not divisible by tp_size={self.tp_size}")
        if self.padded_vocab_size % self.tp_size or self.padded_vocab_size < self.vocab_size:
            raise ConversionError(
                f"padded_vocab_size={self.padded_vocab_size} must be >= vocab_size="
                f"{self.vocab_size} and divisible by tp_size={self.tp_size}"
            )
        counts = self.stage_layer_counts()
        if len(counts) != self.pp_size or sum(counts) != self.num_layers or min(counts) < 1:
            raise ConversionError(
                f"layers_per_stage={counts} does not split num_layers={self.num_layers} "
                f"into pp_size={self.pp_size} non-empty stages"
            )

    @classmethod
    def from_hf_config(
        cls,
        config,
        *,
        spec: Spec = "local",
        tp_size: int = 1,
        pp_size: int = 1,
        make_vocab_size_divisible_by: int = 128,
        layers_per_stage: Sequence[int] | None = None,
    ) -> "MegatronLayout":
        model_type = getattr(config, "model_type", "")
        if model_type not in ("llama", "qwen2", "qwen3", "mistral"):
            raise ConversionError(
                f"model_type={model_type!r}: the Megatron mapping covers llama / qwen2 / qwen3 / mistral"
            )
        if getattr(config, "mlp_bias", False):
            raise ConversionError("mlp_bias=True is not supported by the Megatron mapping")
        window = sliding_window(config)
        if window is not None:
            raise ConversionError(
                f"sliding_window={window} (< max_position_embeddings="
                f"{getattr(config, 'max_position_embeddings', None)}): the Megatron layer specs "
                "here attend over the full causal context and cannot honour a sliding window; "
                "use train.backend=torch, or a config without sliding-window attention"
            )
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        # Llama's attention_bias also adds o_proj.bias, which Megatron's add_qkv_bias lacks: hf_to_megatron then
        # names it as an unmapped tensor instead of dropping it.
        qkv_bias = model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_attention_heads=heads,
            num_query_groups=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            ffn_hidden_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            padded_vocab_size=padded_vocab_size(
                config.vocab_size, divisible_by=make_vocab_size_divisible_by, tp_size=tp_size
            ),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            spec=spec,
            qk_layernorm=model_type == "qwen3",
            tp_size=tp_size,
            pp_size=pp_size,
            layers_per_stage=tuple(layers_per_stage) if layers_per_stage is not None else None,
        )

    def replace(self, **changes) -> "MegatronLayout":
        return dataclasses.replace(self, **changes)

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def input_norm(self) -> str:
        return _NORM_NAMES[self.spec][0]

    @property
    def pre_mlp_norm(self) -> str:
        return _NORM_NAMES[self.spec][1]

    def stage_layer_counts(self) -> tuple[int, ...]:
        if self.layers_per_stage is not None:
            return tuple(self.layers_per_stage)
        if self.num_layers % self.pp_size:
            raise ConversionError(
                f"num_layers={self.num_layers} is not divisible by pp_size={self.pp_size}; pass layers_per_stage"
            )
        return (self.num_layers // self.pp_size,) * self.pp_size

    def layer_offset(self, stage: int) -> int:
        """Global id of stage `stage`'s local layer 0."""
        if not 0 <= stage < self.pp_size:
            raise ConversionError(f"stage={stage} outside 0..{self.pp_size - 1}")
        return sum(self.stage_layer_counts()[:stage])


# ----------------------------------------------------------------------------------------------- QKV


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: MegatronLayout) -> torch.Tensor:
    """HF q/k/v (weights [out, h] or biases [out]) -> Megatron's group-interleaved fused QKV."""
    ng, qpg, d = layout.num_query_groups, layout.heads_per_group, layout.head_dim
    tail = q.shape[1:]
    qg = q.reshape(ng, qpg * d, *tail)
    kg = k.reshape(ng, d, *tail)
    vg = v.reshape(ng, d, *tail)
    return torch.cat([qg, kg, vg], dim=1).reshape(ng * (qpg + 2) * d, *tail).contiguous()


def split_qkv(
    fused: torch.Tensor, layout: MegatronLayout, num_groups: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv` (for `num_groups` groups: a tp shard holds num_query_groups / tp)."""
    ng = num_groups or layout.num_query_groups
    qpg, d = layout.heads_per_group, layout.head_dim
    tail = fused.shape[1:]
    if fused.shape[0] != ng * (qpg + 2) * d:
        raise ConversionError(f"fused QKV has {fused.shape[0]} rows; expected {ng} groups x ({qpg} + 2) x {d}")
    grouped = fused.reshape(ng, (qpg + 2) * d, *tail)
    q, k, v = torch.split(grouped, [qpg * d, d, d], dim=1)
    return (
        q.reshape(ng * qpg * d, *tail).contiguous(),
        k.reshape(ng * d, *tail).contiguous(),
        v.reshape(ng * d, *tail).contiguous(),
    )


# ------------------------------------------------------------------------------------------ HF <-> mcore


def _pad_vocab(t: torch.Tensor, layout: MegatronLayout) -> torch.Tensor:
    if t.shape[0] != layout.vocab_size:
        raise ConversionError(f"vocab tensor has {t.shape[0]} rows; the config says vocab_size={layout.vocab_size}")
    extra = layout.padded_vocab_size - layout.vocab_size
    if not extra:
        return t.clone()
    return torch.cat([t, t.new_zeros((extra, *t.shape[1:]))], dim=0)


def hf_to_megatron(hf: Mapping[str, torch.Tensor], layout: MegatronLayout) -> StateDict:
    """An HF Llama/Qwen2 state dict -> the global (tp=1, pp=1) Megatron state dict."""
    taken: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise ConversionError(f"HF state dict lacks {name!r}")
        taken.add(name)
        return hf[name]

    out: StateDict = {EMBED: _pad_vocab(take("model.embed_tokens.weight"), layout)}
    for i in range(layout.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + layout.input_norm] = take(p + "input_layernorm.weight").clone()
        out[m + QKV_W] = fuse_qkv(
            take(p + "self_attn.q_proj.weight"),
            take(p + "self_attn.k_proj.weight"),
            take(p + "self_attn.v_proj.weight"),
            layout,
        )
        if layout.qkv_bias:
            out[m + QKV_B] = fuse_qkv(
                take(p + "self_attn.q_proj.bias"),
                take(p + "self_attn.k_proj.bias"),
                take(p + "self_attn.v_proj.bias"),
                layout,
            )
        out[m + PROJ_W] = take(p + "self_attn.o_proj.weight").clone()
        if layout.qk_layernorm:
            out[m + Q_NORM] = take(p + "self_attn.q_norm.weight").clone()
            out[m + K_NORM] = take(p + "self_attn.k_norm.weight").clone()
        out[m + layout.pre_mlp_norm] = take(p + "post_attention_layernorm.weight").clone()
        out[m + FC1_W] = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], dim=0)
        out[m + FC2_W] = take(p + "mlp.down_proj.weight").clone()
    out[FINAL_NORM] = take("model.norm.weight").clone()
    if not layout.tie_word_embeddings:
        out[OUTPUT] = _pad_vocab(take("lm_head.weight"), layout)
    elif "lm_head.weight" in hf:
        taken.add("lm_head.weight")  # HF lists the tied head too; it is the embedding
    unmapped = sorted(name for name in hf if name not in taken and not name.endswith("rotary_emb.inv_freq"))
    if unmapped:
        raise ConversionError(
            f"HF tensors the Megatron mapping does not carry (they would be dropped): "
            f"{unmapped[:6]}{' ...' if len(unmapped) > 6 else ''} ({len(unmapped)} in all)"
        )
    return out


def megatron_layer_to_hf(
    suffix: str, tensor: torch.Tensor, layout: MegatronLayout, hf_prefix: str
) -> dict[str, torch.Tensor]:
    """One tp-merged Megatron layer tensor (name without `decoder.layers.{i}.`) -> its HF tensors."""
    if suffix == layout.input_norm:
        return {hf_prefix + "input_layernorm.weight": tensor}
    if suffix == layout.pre_mlp_norm:
        return {hf_prefix + "post_attention_layernorm.weight": tensor}
    if suffix in (QKV_W, QKV_B):
        kind = suffix.rsplit(".", 1)[1]
        q, k, v = split_qkv(tensor, layout)
        return {
            f"{hf_prefix}self_attn.q_proj.{kind}": q,
            f"{hf_prefix}self_attn.k_proj.{kind}": k,
            f"{hf_prefix}self_attn.v_proj.{kind}": v,
        }
    if suffix == PROJ_W:
        return {hf_prefix + "self_attn.o_proj.weight": tensor}
    if suffix == Q_NORM:
        return {hf_prefix + "self_attn.q_norm.weight": tensor}
    if suffix == K_NORM:
        return {hf_prefix + "self_attn.k_norm.weight": tensor}
    if suffix == FC1_W:
        gate, up = torch.chunk(tensor, 2, dim=0)
        return {
            hf_prefix + "mlp.gate_proj.weight": gate.contiguous(),
            hf_prefix + "mlp.up_proj.weight": up.contiguous(),
        }
    if suffix == FC2_W:
        return {hf_prefix + "mlp.down_proj.weight": tensor}
    other_spec = "te" if layout.spec == "local" else "local"
    if suffix in _NORM_NAMES[other_spec]:
        raise ConversionError(
            f"layer tensor {suffix!r} belongs to the {other_spec!r} layer spec, but the layout "
            f"says spec={layout.spec!r}"
        )
    raise ConversionError(f"unknown Megatron layer tensor {suffix!r}")


def _is_extra_state(name: str) -> bool:
    return name.endswith("_extra_state")  # TE modules' fp8 metadata: not a weight


def megatron_to_hf(
    mcore: Mapping[str, torch.Tensor], layout: MegatronLayout, *, layer_offset: int = 0, emit_tied_lm_head: bool = True
) -> StateDict:
    """Global (tp-merged) Megatron tensors -> HF names; vocabulary padding removed.

    `layer_offset` is added to every layer id (for one pipeline stage's local names; 0 for a merged model).
    With tied embeddings, `lm_head.weight` is emitted as the embedding (HF's state_dict lists it too).
    """
    out: StateDict = {}
    for name, tensor in mcore.items():
        if _is_extra_state(name):
            continue
        match = _LAYER.match(name)
        if match:
            layer = int(match.group(1)) + layer_offset
            out.update(megatron_layer_to_hf(match.group(2), tensor, layout, f"model.layers.{layer}."))
        elif name == EMBED:
            out["model.embed_tokens.weight"] = tensor[: layout.vocab_size]
            if layout.tie_word_embeddings and emit_tied_lm_head:
                out["lm_head.weight"] = tensor[: layout.vocab_size]
        elif name == OUTPUT:
            if not layout.tie_word_embeddings:
                out["lm_head.weight"] = tensor[: layout.vocab_size]
            # tied + pp > 1: the last stage's copy of the embedding; the first stage's embedding is exported
        elif name == FINAL_NORM:
            out["model.norm.weight"] = tensor
        else:
            raise ConversionError(f"unknown Megatron tensor {name!r}")
    return out


# ------------------------------------------------------------------------------------- tensor parallel


def _tp_rule(name: str, layout: MegatronLayout) -> str:
    """'column' (dim 0), 'row' (dim 1), 'vocab' (dim 0 of the padded vocab), 'fc1', or 'replicated'."""
    if name in (EMBED, OUTPUT):
        return "vocab"
    match = _LAYER.match(name)
    if not match:
        return "replicated"
    suffix = match.group(2)
    if suffix in (QKV_W, QKV_B):
        return "column"
    if suffix == FC1_W:
        return "fc1"
    if suffix in (PROJ_W, FC2_W):
        return "row"
    return "replicated"  # norms (also TE's fused layer_norm_weight), _extra_state


def tp_rule(name: str, layout: MegatronLayout) -> str:
    """How tensor `name` is split over tensor-parallel ranks: 'column', 'row', 'vocab', 'fc1' or 'replicated'."""
    return _tp_rule(name, layout)


def split_tensor_parallel(mcore: Mapping[str, torch.Tensor], layout: MegatronLayout) -> list[StateDict]:
    """Global Megatron tensors -> one state dict per tp rank, laid out as Megatron's parallel layers hold them."""
    tp = layout.tp_size
    shards: list[StateDict] = [{} for _ in range(tp)]
    for name, tensor in mcore.items():
        rule = _tp_rule(name, layout)
        if rule in ("column", "vocab"):
            parts = torch.chunk(tensor, tp, dim=0)
        elif rule == "row":
            parts = torch.chunk(tensor, tp, dim=1)
        elif rule == "fc1":
            gate, up = torch.chunk(tensor, 2, dim=0)
            parts = [torch.cat([g, u], dim=0) for g, u in zip(torch.chunk(gate, tp, dim=0), torch.chunk(up, tp, dim=0))]
        else:
            parts = [tensor] * tp
        if len(parts) != tp:
            raise ConversionError(f"{name}: shape {tuple(tensor.shape)} does not split into tp_size={tp} parts")
        for rank, part in enumerate(parts):
            shards[rank][name] = part.clone() if not _is_extra_state(name) else part
    return shards


def merge_tensor_parallel(shards: Sequence[Mapping[str, torch.Tensor]], layout: MegatronLayout) -> StateDict:
    """Inverse of `split_tensor_parallel` (replicated tensors must agree across ranks)."""
    if len(shards) != layout.tp_size:
        raise ConversionError(f"got {len(shards)} tp shards; layout says tp_size={layout.tp_size}")
    names = list(shards[0])
    for rank, shard in enumerate(shards[1:], start=1):
        if set(shard) != set(names):
            raise ConversionError(
                f"tp rank {rank} holds other tensors than rank 0: {sorted(set(shard) ^ set(names))[:3]}"
            )
    out: StateDict = {}
    for name in names:
        parts = [shard[name] for shard in shards]
        rule = _tp_rule(name, layout)
        if rule in ("column", "vocab"):
            out[name] = torch.cat(parts, dim=0)
        elif rule == "row":
            out[name] = torch.cat(parts, dim=1)
        elif rule == "fc1":
            halves = [torch.chunk(p, 2, dim=0) for p in parts]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        else:
            if not _is_extra_state(name):
                for rank, part in enumerate(parts[1:], start=1):
                    if not torch.equal(part, parts[0]):
                        raise ConversionError(f"replicated tensor {name} differs between tp rank 0 and {rank}")
            out[name] = parts[0]
    return out


# ----------------------------------------------------------------------------------- pipeline parallel


def split_pipeline(mcore: Mapping[str, torch.Tensor], layout: MegatronLayout) -> list[StateDict]:
    """Global Megatron tensors -> one state dict per pp stage, layers renamed to local ids 0..n-1.

    Stage 0 holds the embedding, the last stage the final norm and the output layer (with tied
    embeddings and pp > 1, Megatron keeps a copy of the embedding there as output_layer.weight).
    """
    stages: list[StateDict] = [{} for _ in range(layout.pp_size)]
    bounds = [(layout.layer_offset(s), layout.layer_offset(s) + n) for s, n in enumerate(layout.stage_layer_counts())]
    last = layout.pp_size - 1
    for name, tensor in mcore.items():
        match = _LAYER.match(name)
        if match:
            layer = int(match.group(1))
            stage = next(s for s, (lo, hi) in enumerate(bounds) if lo <= layer < hi)
            stages[stage][f"decoder.layers.{layer - bounds[stage][0]}.{match.group(2)}"] = tensor
        elif name == EMBED:
            stages[0][name] = tensor
            if layout.tie_word_embeddings and layout.pp_size > 1:
                stages[last][OUTPUT] = tensor.clone()
        else:  # final norm, output layer
            stages[last][name] = tensor
    return stages


def merge_pipeline(stages: Sequence[Mapping[str, torch.Tensor]], layout: MegatronLayout) -> StateDict:
    """Inverse of `split_pipeline`: local layer ids + the stage's offset -> global ids."""
    if len(stages) != layout.pp_size:
        raise ConversionError(f"got {len(stages)} pp stages; layout says pp_size={layout.pp_size}")
    out: StateDict = {}
    for stage, sd in enumerate(stages):
        offset = layout.layer_offset(stage)
        for name, tensor in sd.items():
            match = _LAYER.match(name)
            if match:
                out[f"decoder.layers.{int(match.group(1)) + offset}.{match.group(2)}"] = tensor
            elif name == OUTPUT and layout.tie_word_embeddings:
                continue  # the tied copy; stage 0's embedding is the source of truth
            else:
                out[name] = tensor
    return out


# ----------------------------------------------------------------------------------------- end to end


def to_megatron_shards(hf: Mapping[str, torch.Tensor], layout: MegatronLayout) -> dict[tuple[int, int], StateDict]:
    """HF state dict -> {(pp_stage, tp_rank): state dict as that rank's model holds it}."""
    out = {}
    for stage, stage_sd in enumerate(split_pipeline(hf_to_megatron(hf, layout), layout)):
        for rank, shard in enumerate(split_tensor_parallel(stage_sd, layout)):
            out[(stage, rank)] = shard
    return out


def export_stage_to_hf(
    tp_shards: Sequence[Mapping[str, torch.Tensor]],
    layout: MegatronLayout,
    stage: int,
    *,
    layer_offset: int | None = None,
) -> StateDict:
    """What one pipeline stage sends to the engine: tp-merged, HF-named, global layer ids.

    `layer_offset` defaults to the stage's true offset; it is a parameter only so tests can show what a
    wrong one does.
    """
    merged = merge_tensor_parallel(tp_shards, layout)
    offset = layout.layer_offset(stage) if layer_offset is None else layer_offset
    return megatron_to_hf(merged, layout, layer_offset=offset)


def from_megatron_shards(
    shards: Mapping[tuple[int, int], Mapping[str, torch.Tensor]], layout: MegatronLayout
) -> StateDict:
    """{(pp_stage, tp_rank): state dict} -> the HF state dict (vocab padding removed)."""
    out: StateDict = {}
    for stage in range(layout.pp_size):
        tp_shards = [shards[(stage, rank)] for rank in range(layout.tp_size)]
        for name, tensor in export_stage_to_hf(tp_shards, layout, stage).items():
            if name in out:
                raise ConversionError(f"{name} exported by two pipeline stages (stage {stage} and an earlier one)")
            out[name] = tensor
    return out


def hf_layer_name_map(layer_offset: int) -> Callable[[str], str]:
    """A parity `NameMap` for HF names whose layer ids are stage-local (adds the stage's offset)."""

    def name_map(name: str) -> str:
        match = _HF_LAYER.match(name)
        return f"model.layers.{int(match.group(1)) + layer_offset}.{match.group(2)}" if match else name

    return name_map
