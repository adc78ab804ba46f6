"""Where model weights come from: the built-in warm-started tiny model, or a local HF directory."""

from __future__ import annotations

from pathlib import Path

BUILTIN_MODELS = {"builtin:addition": Path(__file__).parent / "builtin" / "addition-sft"}


def resolve_model_path(spec: str) -> Path:
    """`builtin:addition` (shipped in the package) or a local directory path."""
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
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"model.path={spec!r} has no config.json; point it at a local HF model directory "
            "(config.json + *.safetensors + tokenizer) or use 'builtin:addition'"
        )
    return path
