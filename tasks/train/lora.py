"""LoRA on a HF causal LM (`model.lora`): wrapping with peft, the adapter tensors, and the merge into HF-named weights.

peft is optional (extra `lora`) and imported only by `wrap_lora`; the merge is plain torch, so an engine that
starts from a LoRA checkpoint while no trainer runs needs no peft (tasks/train/checkpoint_weights.py).
"""

from __future__ import annotations

import importlib.util

import torch

from rollflow.tasks.train.settings import LoraSettings

PEFT_MISSING = "model.lora is set but peft is not installed: pip install 'rollflow[lora]' (or drop model.lora)"
ADAPTER = "default"  # peft's name of the one adapter the policy gets
_A, _B = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"
PEFT_PREFIX = "base_model.model."  # what a PeftModel puts before the HF names
LORA_FORMAT = "rollflow-lora-1"  # a LoRA trainer's checkpoint payload: adapter, optimizer, RNG (no base weights)


def peft_available() -> bool:
    return importlib.util.find_spec("peft") is not None


def wrap_lora(model: torch.nn.Module, lora: LoraSettings) -> torch.nn.Module:
    """`model` inside a peft PeftModel with one adapter; only the adapter's A and B require grad.

    A is drawn from the torch RNG (seed it first: a run then starts from the same adapter every time), B is
    zero, so the wrapped model computes exactly what `model` does until B moves."""
    try:
        import peft
    except ImportError:
        raise RuntimeError(PEFT_MISSING) from None
    config = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
    )
    try:
        # autocast_adapter_dtype=False: the adapter takes the trainer's dtype like every other parameter.
        wrapped = peft.get_peft_model(model, config, autocast_adapter_dtype=False)
    except ValueError as exc:  # no module matched the targets
        raise ValueError(f"model.lora.target_modules={list(lora.target_modules)}: {exc}") from None
    not_linear = sorted(
        name
        for name, module in wrapped.named_modules()
        if isinstance(module, peft.tuners.lora.LoraLayer) and not isinstance(module.base_layer, torch.nn.Linear)
    )
    if not_linear:
        raise ValueError(
            f"model.lora.target_modules={list(lora.target_modules)} matches non-Linear modules "
            f"({not_linear[0]}, ...); target the attention / MLP projections only"
        )
    return wrapped


def lora_dropouts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The adapter-input dropout modules (train mode turns them on without touching the rest of the model)."""
    return [m for name, m in model.named_modules() if name.endswith(f"lora_dropout.{ADAPTER}")]


def adapter_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The trainable adapter tensors by their PeftModel names (`base_model.model.<module>.lora_A.default.weight`)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def base_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The frozen base weights of a PeftModel under their HF names, detached, where they live (no copy)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if ".lora_" in name:
            continue
        out[name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")] = tensor
    return out


def merge_adapter(
    base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], scaling: float
) -> dict[str, torch.Tensor]:
    """HF-named weights with the adapter folded in: W + (B @ A) * scaling for every adapted module, the base
    tensors themselves elsewhere. Neither input is modified (the merged tensors are new)."""
    out = dict(base)
    for name, a in adapter.items():
        if not name.endswith(_A):
            continue
        module = name.removeprefix(PEFT_PREFIX).removesuffix(_A)
        b = adapter[name.removesuffix(_A) + _B]
        weight = base[f"{module}.weight"]
        with torch.no_grad():
            out[f"{module}.weight"] = weight + (b.to(weight.device) @ a.to(weight.device)) * scaling
    return out


def peft_named(adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter under the names of a saved PEFT adapter (`adapter_model.safetensors`:
    `base_model.model.<module>.lora_A.weight`, no adapter name), which SGLang's LoRA loader reads."""
    return {name.replace(f".{ADAPTER}.weight", ".weight"): t for name, t in adapter.items()}


def adapter_config(lora: LoraSettings) -> dict:
    """The PEFT `adapter_config.json` of the policy's adapter (SGLang reads r, lora_alpha, target_modules,
    use_dora; its scaling is lora_alpha / r, the trainer's)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.target_modules),
        "bias": "none",
        "use_dora": False,
        "use_rslora": False,
    }
