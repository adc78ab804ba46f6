"""Model dtypes by config name (`rollout.dtype`, `train.dtype`, sync casts): one table for the
rollout engine, the trainers and the weight sync."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def cast_model(model, dtype: torch.dtype, device: str | torch.device | None = None):
    """`model` on `device` with its parameters and state-dict buffers in `dtype`, like a model loaded with
    `from_pretrained(dtype=...)`: buffers outside the state dict (RoPE `inv_freq`) keep their dtype.

    `model.to(dtype)` would round `inv_freq` to bf16 too, and a bf16 trainer would then compute other
    rotary angles than a bf16 engine loaded in that dtype (1e-3 log-prob differences that no weight
    checksum shows, since the buffer is not synced)."""
    if device is not None:
        model = model.to(device)
    saved = {id(b) for b in model.state_dict(keep_vars=True).values()}
    for module in model.modules():
        for _name, param in module.named_parameters(recurse=False):
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
        for name, buf in module.named_buffers(recurse=False):
            if buf.is_floating_point() and buf.dtype != dtype and id(buf) in saved:
                setattr(module, name, buf.to(dtype))
    return model
