"""`rollout.sglang`: settings of the SGLang rollout engine (a section of RolloutConfig).

Only read when `rollout.engine == "sglang"`; the defaults change nothing for the `hf` engine.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rollflow.tasks.rollout.sglang.flags import load_flags, validate_args

# Colocated, SGLang's static pool (weights + KV cache, a share of the GPU's memory) and the trainer rank
# share each GPU, and stay resident together while weights sync: their shares must leave this much
# headroom for CUDA contexts, IPC bucket copies and activations.
FIT_LIMIT = 0.9

# ServerArgs fields rollflow sets from its own settings: a passthrough may not set them a second way.
MANAGED_FIELDS = {
    "model_path": "model.path",
    "host": "rollout.sglang.host",
    "port": "rollout.sglang.port",
    "tp_size": "rollout.sglang.tp_size (or resources.gpus_per_engine)",
    "mem_fraction_static": "rollout.sglang.mem_fraction_static",
    "dtype": "rollout.sglang.dtype (or rollout.dtype)",
    "skip_tokenizer_init": "rollout.sglang.skip_tokenizer_init",
    "weight_version": "(the engine's weight_version)",
    "enable_memory_saver": "rollout.sglang.memory_saver (on with offload=true)",
}
# ServerArgs fields lora_sync=adapter sets (a passthrough may set them only without it)
LORA_FIELDS = {
    "enable_lora": "rollout.sglang.lora_sync=adapter",
    "max_lora_rank": "rollout.sglang.lora_max_rank (model.lora.rank)",
    "lora_target_modules": "rollout.sglang.lora_target_modules (model.lora.target_modules)",
    "lora_paths": "rollout.sglang.lora_sync=adapter (adapters come from the trainer)",
}


class SGLangConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    urls: list[str] = Field(
        default_factory=list,
        description="already running SGLang servers (http://host:port); set = launch nothing, balance over these",
    )
    launcher: list[str] = Field(
        default_factory=list,
        description="program that replaces `{python} -m sglang.launch_server` (a wrapper such as nsys, or a test "
        "double); the server flags are appended",
    )
    python: Optional[str] = Field(None, description="interpreter that has SGLang (default: this one)")
    host: str = Field(
        "127.0.0.1",
        description="address launched servers bind; 127.0.0.1 keeps them private to their node (the rollout worker "
        "must then run there too); 0.0.0.0 lets engines on other nodes of the Ray cluster be reached at "
        "their node's IP",
    )
    tp_size: Optional[int] = Field(
        None, ge=1, description="tensor parallel size (default: resources.gpus_per_engine, or 1)"
    )
    port: Optional[int] = Field(None, ge=1, le=65535, description="server port on 127.0.0.1 (default: a free one)")
    mem_fraction_static: Optional[float] = Field(
        None,
        gt=0,
        lt=1,
        description="--mem-fraction-static (default: SGLang's; placement=colocate: "
        f"{FIT_LIMIT:g} - colocate_trainer_fraction)",
    )
    colocate_trainer_fraction: float = Field(
        0.4,
        gt=0,
        lt=1,
        description="placement=colocate: share of each GPU the trainer rank keeps (weights, "
        "gradients, optimizer states, activations); engine + trainer must fit",
    )
    dtype: Optional[str] = Field(None, description="--dtype (default: bfloat16; rollout.dtype when that is set)")
    skip_tokenizer_init: bool = Field(True, description="token ids in and out; rollflow decodes with its own tokenizer")
    memory_saver: bool = Field(
        False, description="--enable-memory-saver: release/resume weights and KV cache (turned on by offload=true)"
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="any other SGLang server flag, e.g. {'disable-cuda-graph': true, 'speculative-algorithm': "
        "'EAGLE', 'moe-a2a-backend': 'deepep'}; CLI: --sglang-<flag>[=value]",
    )
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of the server process")
    startup_timeout_s: float = Field(900.0, gt=0, description="wait this long for /health after launch")
    request_timeout_s: float = Field(3600.0, gt=0)
    max_inflight: int = Field(256, ge=1, description="concurrent /generate requests per engine call")
    load_balance: Literal["round_robin", "least_outstanding"] = "least_outstanding"
    n_mode: Literal["repeat", "native"] = Field(
        "repeat", description="repeat: one request per sample (abortable one by one); native: sampling_params.n"
    )
    weight_sync: Literal["auto", "disk", "tensor", "distributed"] = Field(
        "auto", description="auto: tensor when colocated, disk when disaggregated"
    )
    weight_sync_backend: Literal["nccl", "gloo"] = Field(
        "nccl", description="process-group backend of weight_sync=distributed (gloo: CPU-only test setups)"
    )
    lora_sync: Literal["merged", "adapter"] = Field(
        "merged",
        description="with model.lora: merged = the merged weights through weight_sync, as without LoRA; adapter = "
        "only the adapter, through SGLang's LoRA adapter API (servers launched with --enable-lora, generate "
        "requests name the adapter); weight_sync=disk -> /load_lora_adapter from a directory, tensor or "
        "distributed -> /load_lora_adapter_from_tensors",
    )
    lora_max_rank: Optional[int] = Field(
        None, ge=1, description="--max-lora-rank (lora_sync=adapter: set from model.lora.rank)"
    )
    lora_target_modules: Optional[list[str]] = Field(
        None, description="--lora-target-modules (lora_sync=adapter: set from model.lora.target_modules)"
    )
    bucket_mb: int = Field(512, ge=1, description="weights per update request / broadcast bucket, in MiB")
    weight_dir: Optional[str] = Field(None, description="where disk weight updates are written (default: a temp dir)")
    seeded: bool = Field(
        False, description="send sampling_seed (SGLang honours it with --enable-deterministic-inference)"
    )
    log_tail_lines: int = Field(40, ge=1, description="server log lines quoted when the server dies")

    @field_validator("args")
    @classmethod
    def _known_flags(cls, value: dict[str, Any]) -> dict[str, Any]:
        args = validate_args(value)
        flags = load_flags()
        for key in args:
            spec = flags.get(key)
            if spec.field in MANAGED_FIELDS:
                raise ValueError(
                    f"rollout.sglang.args sets {spec.flag}, which rollflow sets from "
                    f"{MANAGED_FIELDS[spec.field]}; use that field"
                )
        return args

    @field_validator("urls")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        for url in value:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"rollout.sglang.urls: {url!r} is not an http(s) URL (e.g. http://10.0.0.5:30000)")
        return [u.rstrip("/") for u in value]

    def resolved_weight_sync(self, placement: str) -> str:
        if self.weight_sync != "auto":
            return self.weight_sync
        return "tensor" if placement == "colocate" else "disk"


def colocated_mem_fraction(cfg: SGLangConfig) -> float:
    """--mem-fraction-static for an engine sharing its GPUs with a trainer rank: the configured one if it
    fits beside `colocate_trainer_fraction`, else a ValueError naming both fields."""
    limit = round(FIT_LIMIT - cfg.colocate_trainer_fraction, 4)
    if cfg.mem_fraction_static is None:
        if limit <= 0.05:
            raise ValueError(
                f"rollout.sglang.colocate_trainer_fraction={cfg.colocate_trainer_fraction:g} leaves no "
                f"memory for a colocated engine (engine + trainer <= {FIT_LIMIT:g}); lower it"
            )
        return limit
    if cfg.mem_fraction_static > limit:
        raise ValueError(
            f"rollout.sglang.mem_fraction_static={cfg.mem_fraction_static:g} + rollout.sglang."
            f"colocate_trainer_fraction={cfg.colocate_trainer_fraction:g} > {FIT_LIMIT:g}: a colocated "
            f"engine and trainer rank do not fit on one GPU; set mem_fraction_static <= {limit:g}"
        )
    return cfg.mem_fraction_static


def check_lora_adapter_sync(sg: SGLangConfig, lora: Any, engine: str, placement: str) -> str:
    """lora_sync=adapter (`lora`: model.lora): an adapter to send, an engine that applies it, launch flags that
    take it (set here from model.lora when unset). Raises a one-line ValueError; returns the notice."""
    if lora is None:
        raise ValueError(
            "rollout.sglang.lora_sync='adapter' without model.lora: there is no adapter to send; set model.lora "
            "or rollout.sglang.lora_sync='merged'"
        )
    if engine != "sglang":
        raise ValueError(
            f"rollout.sglang.lora_sync='adapter' with rollout.engine={engine!r}: only SGLang applies adapters "
            "itself (the hf engine takes merged weights); set rollout.engine='sglang' or "
            "rollout.sglang.lora_sync='merged'"
        )
    for key in sg.args:
        field = load_flags().get(key).field
        if field in LORA_FIELDS:
            raise ValueError(
                f"rollout.sglang.args sets --{key}, which rollflow sets with lora_sync='adapter' (from "
                f"{LORA_FIELDS[field]}); drop it from rollout.sglang.args"
            )
    if sg.lora_max_rank is not None and sg.lora_max_rank < lora.rank:
        raise ValueError(
            f"rollout.sglang.lora_max_rank={sg.lora_max_rank} < model.lora.rank={lora.rank}: SGLang refuses the "
            "adapter; raise it or leave it unset (model.lora.rank)"
        )
    missing = sorted(set(lora.target_modules) - set(sg.lora_target_modules or lora.target_modules))
    if missing and "all" not in (sg.lora_target_modules or []):
        raise ValueError(
            f"rollout.sglang.lora_target_modules lacks {missing} of model.lora.target_modules: SGLang refuses the "
            "adapter; add them or leave it unset"
        )
    if sg.lora_max_rank is None:
        sg.lora_max_rank = lora.rank
    if sg.lora_target_modules is None:
        sg.lora_target_modules = list(lora.target_modules)
    disk = sg.resolved_weight_sync(placement) == "disk"
    route = "load_lora_adapter" if disk else "load_lora_adapter_from_tensors"
    return (
        f"rollout.sglang.lora_sync=adapter: servers launched with --enable-lora --max-lora-rank {sg.lora_max_rank} "
        f"--lora-target-modules {' '.join(sg.lora_target_modules)}; every sync loads the adapter through /{route}"
    )
