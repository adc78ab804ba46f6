"""The HF-named weights inside a committed checkpoint's payload, read without a trainer.

Apart from checkpoint.py so that the checkpoint index's readers (the CLI, a flow's resume) do not load torch.
"""

from __future__ import annotations

import io
import os

import torch

from rollflow.tasks.model.tiny import load_model
from rollflow.tasks.sync import megatron_names as mn
from rollflow.tasks.train.checkpoint import is_distributed_payload
from rollflow.tasks.train.lora import LORA_FORMAT, merge_adapter
from rollflow.tasks.train.settings import LoraSettings


def hf_weights_of_checkpoint(payload: bytes, model_path: str | os.PathLike) -> dict:
    """The HF-named weights of a committed checkpoint's payload, read without a trainer (an engine that starts
    from a checkpoint while no trainer runs). A torch backend's checkpoint holds them as they are; a one-rank
    megatron checkpoint holds Megatron-named tensors, converted with the model's HF config (`model_path`); a LoRA
    trainer's holds its adapter, merged here into the base weights of `model_path`; a sharded trainer's
    (Megatron's distributed format) only the trainer ranks can read."""
    if is_distributed_payload(payload):
        raise ValueError(
            "the checkpoint is a sharded megatron trainer's (Megatron's distributed format): only the "
            "trainer ranks read it; start the trainer first and take the engine's weights from it"
        )
    state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    if state.get("format") == LORA_FORMAT:
        adapter = state["adapter"]
        dtype = next(iter(adapter.values())).dtype  # the trainer's dtype, which its base was loaded in
        base = {k: v.detach() for k, v in load_model(model_path, dtype=dtype).state_dict().items()}
        merged = merge_adapter(base, adapter, LoraSettings.model_validate(state["lora"]).scaling)
        return {k: v.clone() for k, v in merged.items()}
    if state.get("format") != "rollflow-megatron-1":
        return state["model"]
    from transformers import AutoConfig

    model = state["model"]
    spec = "te" if any(name.endswith("layer_norm_weight") for name in model) else "local"  # TE fuses the norms
    layout = mn.MegatronLayout.from_hf_config(AutoConfig.from_pretrained(str(model_path)), spec=spec)
    return {name: tensor.clone() for name, tensor in mn.megatron_to_hf(model, layout).items()}
