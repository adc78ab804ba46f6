"""Where rollflow's RolloutConfig meets SGLang: the launch settings of an engine's server, its environment
and dtype, and the `SGLangEngine` itself, from `rollout.sglang` (the section of settings in config.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from rollflow.tasks.rollout.settings import RolloutConfig
from rollflow.tasks.rollout.sglang.engine import SGLangEngine
from rollflow.tasks.rollout.sglang.server import LaunchSpec, SGLangServer, free_port

# SGLang engines default to bf16 (what SGLang serves in RL setups); rollout.dtype's float32 default is the
# hf engine's, so it applies to SGLang only when set explicitly.
SGLANG_DEFAULT_DTYPE = "bfloat16"


def engine_dtype(rollout: RolloutConfig) -> str:
    """The dtype SGLang engines run: rollout.sglang.dtype, else rollout.dtype if set explicitly, else bf16."""
    if rollout.sglang.dtype:
        return rollout.sglang.dtype
    if "dtype" in rollout.model_fields_set:
        return rollout.dtype
    return SGLANG_DEFAULT_DTYPE


def launch_spec_for(
    model_dir: str | Path,
    rollout: RolloutConfig,
    *,
    port: int | None = None,
    base_gpu_id: int | None = None,
    weight_version: int | None = None,
) -> LaunchSpec:
    """The launch settings of one engine's server from `rollout.sglang` (plus rollflow-managed fields)."""
    cfg = rollout.sglang
    return LaunchSpec(
        model_path=str(model_dir),
        port=port or cfg.port or free_port(),
        tp_size=cfg.tp_size or 1,
        host=cfg.host,
        mem_fraction_static=cfg.mem_fraction_static,
        dtype=engine_dtype(rollout),
        skip_tokenizer_init=cfg.skip_tokenizer_init,
        enable_memory_saver=cfg.memory_saver,
        base_gpu_id=base_gpu_id,
        weight_version=weight_version,
        lora_max_rank=cfg.lora_max_rank if cfg.lora_sync == "adapter" else None,
        lora_target_modules=tuple(cfg.lora_target_modules or ()) if cfg.lora_sync == "adapter" else (),
        args=cfg.args,
        launcher=tuple(cfg.launcher),
        python=cfg.python,
    )


# torch's allocator settings: SGLang's memory saver (--enable-memory-saver) installs its own allocator
# hooks, which an inherited PYTORCH_CUDA_ALLOC_CONF (e.g. expandable_segments from the trainer's
# environment) breaks; SGLang strips the same two variables for its own helper processes.
ALLOCATOR_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def dropped_env(rollout: RolloutConfig) -> tuple[str, ...]:
    """Variables of the launching process the server must not inherit."""
    return ALLOCATOR_ENV if rollout.sglang.memory_saver else ()


def server_env(rollout: RolloutConfig, gpu_ids: Sequence[str] | None) -> dict[str, str]:
    """The server's extra environment. With `gpu_ids` (the physical GPUs of the engine's bundles, as
    Ray numbers them) the server sees exactly those GPUs, so its TP ranks 0..G-1 are the engine's GPUs
    and `--base-gpu-id` stays 0, even when the bundles got non-adjacent GPUs."""
    env = dict(rollout.sglang.env)
    if gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids)
    return env


def engine_options(
    model_dir: str | Path, rollout: RolloutConfig, *, model_name: str, weight_version: int = 0
) -> dict[str, Any]:
    """SGLangEngine keyword arguments from a RolloutConfig (everything but the servers)."""
    cfg = rollout.sglang
    weight_sync = "disk" if cfg.weight_sync == "auto" else cfg.weight_sync
    tensor_device = None
    if weight_sync == "tensor":
        tensor_device = "cuda" if torch.cuda.is_available() else None
    return dict(
        model_name=model_name,
        weight_version=weight_version,
        tp_sizes=cfg.tp_size or 1,
        request_timeout=cfg.request_timeout_s,
        max_inflight=cfg.max_inflight,
        load_balance=cfg.load_balance,
        n_mode=cfg.n_mode,
        seeded=cfg.seeded,
        weight_sync=weight_sync,
        weight_dir=cfg.weight_dir,
        config_dir=model_dir,
        tensor_device=tensor_device,
        bucket_bytes=cfg.bucket_mb * 2**20,
        lora_sync=cfg.lora_sync,
    )


def engine_from_config(
    model_dir: str | Path,
    rollout: RolloutConfig,
    *,
    model_name: str,
    weight_version: int = 0,
    base_gpu_id: int | None = None,
    log_dir: str | Path | None = None,
    servers: Sequence[Any] | None = None,
) -> SGLangEngine:
    """An SGLangEngine over `servers` (already launched, e.g. one Ray actor per engine: objects with the
    SGLangServer interface), over `rollout.sglang.urls`, or over one server launched here on loopback.

    `rollout` is a RolloutConfig (its `sglang` section holds the launch settings). SGLang itself is
    needed only to launch the default `python -m sglang.launch_server`; a missing install is reported
    here, at use time, with the install hint.
    """
    common = engine_options(model_dir, rollout, model_name=model_name, weight_version=weight_version)
    if servers:
        return SGLangEngine([s.url for s in servers], servers=servers, **common)
    if rollout.sglang.urls:
        return SGLangEngine(rollout.sglang.urls, **common)
    spec = launch_spec_for(model_dir, rollout, base_gpu_id=base_gpu_id, weight_version=weight_version)
    log_path = Path(log_dir) / f"sglang-{spec.port}.log" if log_dir else None
    server = SGLangServer(
        spec,
        log_path=log_path,
        env=server_env(rollout, None),
        tail_lines=rollout.sglang.log_tail_lines,
        drop_env=dropped_env(rollout),
    ).start()
    try:
        server.wait_healthy(rollout.sglang.startup_timeout_s)
    except BaseException:
        server.stop(timeout=10)
        raise
    return SGLangEngine([server.url], servers=[server], **common)
