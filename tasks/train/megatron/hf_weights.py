"""HF-named weights into and out of this rank's Megatron model chunks: loading through the converter
(`rollflow.tasks.sync.megatron_names`), and the per-layer pieces the export gathers over tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from rollflow.tasks.sync import megatron_names as mn


def virtual_stage(pp_rank: int, pp_size: int, vp_stage: int | None) -> int:
    """Index of a model chunk in the layer order: interleaving gives rank r's chunk v the layers of stage v*pp + r."""
    return pp_rank if vp_stage is None else vp_stage * pp_size + pp_rank


def load_hf_weights(
    model: torch.nn.Module, hf_state: dict[str, torch.Tensor], layout: mn.MegatronLayout, vp_stage: int | None = None
) -> None:
    """Copy an HF state dict into this rank's Megatron model (its tp shard of its pp stage) through the
    converter; strict on names (and the converter is strict on HF tensors it does not map)."""
    from megatron.core import parallel_state  # optional dependency: imported on use

    if layout.tp_size * layout.pp_size == 1:
        converted = mn.hf_to_megatron(hf_state, layout)
    else:
        stage = virtual_stage(
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            vp_stage,
        )
        converted = mn.to_megatron_shards(hf_state, layout)[(stage, parallel_state.get_tensor_model_parallel_rank())]
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    missing = sorted(set(own) - set(converted))
    unexpected = sorted(set(converted) - set(own))
    if missing or unexpected:
        raise mn.ConversionError(
            f"HF -> Megatron names do not match the model: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    with torch.no_grad():
        for name, target in own.items():
            source = converted[name]
            if tuple(source.shape) != tuple(target.shape):
                raise mn.ConversionError(
                    f"{name}: converted shape {tuple(source.shape)} != model's {tuple(target.shape)}"
                )
            target.copy_(source.to(dtype=target.dtype))


def chunk_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def layer_groups(weights: dict[str, torch.Tensor]) -> Iterator[list[str]]:
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


def gather_shards(part: dict[str, torch.Tensor], tp_size: int, group) -> list[dict[str, torch.Tensor]]:
    """Every TP rank's shard of each tensor in `part`, all-gathered on the device."""
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp_size)]
    for name, tensor in part.items():
        parts = [torch.empty_like(tensor) for _ in range(tp_size)]
        torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
        for rank, piece in enumerate(parts):
            shards[rank][name] = piece
    return shards
