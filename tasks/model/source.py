"""Where model weights come from: the built-in warm-started tiny model, or a local HF directory.

A local directory must hold a complete checkpoint: `config.json` of a supported architecture (the
Llama / Qwen2 / Qwen3 / Qwen3-MoE families: what the `hf` engine, the `torch` trainer and the weight sync are
tested on), the weights as safetensors (never pickled `.bin` files), and a tokenizer. The check runs
before anything is loaded and names the missing file, so an incomplete download fails in a second
with its fix, not minutes later inside transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rollflow.tasks.model.tokenizer import CHAR_TOKENIZER_FILE

BUILTIN_MODELS = {
    "builtin:addition": Path(__file__).parent / "builtin" / "addition-sft",
    # Seeded random-init Qwen3-MoE for the MoE / routing-replay paths (tasks/model/tiny_moe.py).
    "builtin:addition-moe": Path(__file__).parent / "builtin" / "addition-moe",
}

# model_type -> family name. Decoder-only models that share the Llama layout (attention + MLP or MoE block).
SUPPORTED_MODEL_TYPES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3-MoE"}
# The MoE families: the hf engine and the torch trainer run them; megatron does not (flows/config.py).
MOE_MODEL_TYPES = frozenset({"qwen3_moe"})
TOKENIZER_FILES = (CHAR_TOKENIZER_FILE, "tokenizer.json", "tokenizer.model", "vocab.json")
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


class ModelDirError(FileNotFoundError):
    """A model directory that cannot be loaded (missing file or unsupported architecture)."""


def _read_json(path: Path, spec: str) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelDirError(f"model.path={spec!r}: {path.name} is not readable JSON ({exc})") from None


def check_model_dir(path: str | Path, *, spec: str | None = None, tokenizer: bool = True) -> dict[str, Any]:
    """Validate a local HF model directory; returns {model_type, family, weights, tokenizer, chat_template}.

    Raises `ModelDirError` naming the missing file, or `ValueError` for an unsupported architecture.
    """
    path = Path(path)
    spec = spec or str(path)
    if not path.is_dir():
        raise ModelDirError(
            f"model.path={spec!r} is not a directory; point it at a local HF model directory "
            "(config.json + *.safetensors + tokenizer) or use 'builtin:addition'"
        )
    if not (path / "config.json").exists():
        raise ModelDirError(
            f"model.path={spec!r} is missing config.json; point it at a local HF model directory "
            "(config.json + *.safetensors + tokenizer) or use 'builtin:addition'"
        )
    config = _read_json(path / "config.json", spec)
    model_type = str(config.get("model_type", ""))
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = ", ".join(config.get("architectures") or []) or "no architectures listed"
        raise ValueError(
            f"model.path={spec!r}: architecture model_type={model_type or '?'!r} ({archs}) is not supported; "
            f"rollflow runs the Llama / Qwen2 / Qwen3 / Qwen3-MoE families (model_type "
            f"{', '.join(repr(t) for t in SUPPORTED_MODEL_TYPES)})"
        )
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise ValueError(
            f"model.path={spec!r}: config.json has a quantization_config (quant_method={method!r}); "
            "save a dequantized checkpoint (fp32 / bf16 safetensors) for training"
        )
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(_read_json(index, spec).get("weight_map", {}).values()))
        missing = [s for s in shards if not (path / s).exists()]
        if missing:
            raise ModelDirError(
                f"model.path={spec!r} is missing weight shard(s) {missing[:3]} listed in "
                "model.safetensors.index.json (incomplete copy?)"
            )
        weights = shards
    else:
        weights = sorted(p.name for p in path.glob("*.safetensors"))
    if not weights:
        pickled = sorted(p.name for p in path.glob("*.bin"))
        hint = f" (found {pickled[:2]}: pickled weights are not loaded; convert them to safetensors)" if pickled else ""
        raise ModelDirError(f"model.path={spec!r} is missing model.safetensors (no *.safetensors weights){hint}")
    tok_file = next((name for name in TOKENIZER_FILES if (path / name).exists()), None)
    if tokenizer and tok_file is None:
        raise ModelDirError(
            f"model.path={spec!r} is missing its tokenizer (tokenizer.json, tokenizer.model, "
            f"vocab.json or {CHAR_TOKENIZER_FILE}); save the tokenizer next to the weights "
            "(tokenizer.save_pretrained(dir))"
        )
    return {
        "model_type": model_type,
        "family": SUPPORTED_MODEL_TYPES[model_type],
        "weights": weights,
        "tokenizer": tok_file,
        "chat_template": has_chat_template_file(path),
    }


def has_chat_template_file(path: str | Path) -> bool:
    path = Path(path)
    if any((path / name).exists() for name in CHAT_TEMPLATE_FILES):
        return True
    config = path / "tokenizer_config.json"
    if config.exists():
        try:
            return bool(json.loads(config.read_text()).get("chat_template"))
        except (OSError, json.JSONDecodeError):
            return False
    return False


def resolve_model_path(spec: str) -> Path:
    """A built-in (`builtin:addition`, `builtin:addition-moe`: shipped in the package) or a local directory
    path (checked: see `check_model_dir`)."""
    if spec in BUILTIN_MODELS:
        path = BUILTIN_MODELS[spec]
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"model.path={spec!r}: the built-in weights are missing at {path}; run `rollflow warmstart` "
                "to rebuild them"
            )
        return path
    if spec.startswith("builtin:"):
        raise ValueError(f"model.path={spec!r}: unknown built-in; known: {sorted(BUILTIN_MODELS)}")
    path = Path(spec).expanduser()
    check_model_dir(path, spec=spec)
    return path


def model_type_of(spec: str) -> str:
    """config.json's model_type of `spec` (a built-in or a local directory), '' when unreadable: config
    validation asks it before any worker starts, and a missing directory is reported later, by name."""
    path = BUILTIN_MODELS.get(spec) or Path(spec).expanduser()
    try:
        return str(json.loads((path / "config.json").read_text()).get("model_type", ""))
    except (OSError, json.JSONDecodeError):
        return ""
