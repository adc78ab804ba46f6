"""The disk weight path's writer: the trainer's HF-named tensors as an HF safetensors directory, which
SGLang then loads with `POST /update_weights_from_disk` (see weight_receiver.py)."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Mapping

CONFIG_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja", ".py")
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def write_hf_checkpoint(
    named_tensors: Mapping[str, Any],
    out_dir: str | Path,
    *,
    config_dir: str | Path | None = None,
    config: Mapping[str, Any] | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> Path:
    """Write HF-named tensors as `model.safetensors` (or shards + `model.safetensors.index.json`) plus
    the model's config files, into `out_dir` atomically (a temp sibling renamed at the end)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        if config_dir is not None:
            for item in Path(config_dir).iterdir():
                if item.is_file() and item.suffix in CONFIG_SUFFIXES and item.name not in WEIGHT_FILES:
                    shutil.copy2(item, tmp / item.name)
        if config is not None:
            (tmp / "config.json").write_text(json.dumps(dict(config), indent=2))
        if not (tmp / "config.json").exists():
            raise ValueError("write_hf_checkpoint needs config_dir (with config.json) or config")
        tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in named_tensors.items()}
        shards: list[dict[str, Any]] = [{}]
        size = 0
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t
            size += nbytes
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map, total = {}, 0
            for i, shard in enumerate(shards, start=1):
                fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                for name, t in shard.items():
                    weight_map[name] = fname
                    total += t.numel() * t.element_size()
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
            )
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
