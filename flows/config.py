"""`RunConfig`: the single, validated parameter object of every flow (rendered as a form in the UI)."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Literal, Optional

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from rollflow.artifacts.store import validate_run
from rollflow.infra.placement import ResourcesConfig, plan_placement
from rollflow.tasks.model.source import MOE_MODEL_TYPES, model_type_of
from rollflow.tasks.model.teacher_forced import ScoringLayout
from rollflow.tasks.rollout.pipeline_settings import PipelineConfig
from rollflow.tasks.rollout.settings import DataConfig, RolloutConfig, resolve_hf_weight_sync
from rollflow.tasks.rollout.sglang.config import check_lora_adapter_sync, colocated_mem_fraction
from rollflow.tasks.rollout.sglang.from_config import engine_dtype
from rollflow.tasks.train.lora import PEFT_MISSING, peft_available
from rollflow.tasks.train.settings import LORA_BACKEND_REFUSED, AlgoConfig, LoraSettings, OptimConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    path: str = Field(
        "builtin:addition",
        description="'builtin:addition', 'builtin:addition-moe' (tiny Qwen3-MoE) or a local HF model directory",
    )
    lora: Optional[LoraSettings] = Field(
        None,
        description="train low-rank adapters on the frozen model (torch backend, peft; extra 'lora'); "
        "None = full fine-tuning. Engines receive the merged weights",
    )


def reject_credentials(value: Optional[str], field: str) -> Optional[str]:
    """URLs in the config end up in Prefect parameters, logs and artifacts: no credentials in them."""
    if value is None or "://" not in value:
        return value
    from urllib.parse import parse_qs, urlsplit

    parts = urlsplit(value)
    secret_query = [k for k in parse_qs(parts.query) if re.search(r"key|secret|token|password|signature", k, re.I)]
    if "@" in parts.netloc or secret_query:
        scheme = parts.scheme or "s3"
        raise ValueError(
            f"{field} must not contain credentials (user:secret@ or key/secret/token query parameters); "
            f"write it as {scheme}://bucket/prefix and give credentials through the environment "
            "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE; AWS_ENDPOINT_URL for S3-compatible stores)"
        )
    return value


class StoreConfig(_Strict):
    root: str = Field(
        "runs",
        description="artifact root: a local path or any fsspec URL (file://, s3://); "
        "S3 credentials and endpoint come from the AWS environment variables",
    )
    results: Optional[str] = Field(
        None,
        description="Prefect result storage of cached task results (replay steps): a local path, or a saved "
        "Prefect filesystem block as 'type/name' (e.g. remote-file-system/rollflow-s3 with basepath "
        "s3://bucket/results) so workers on other machines reuse them; default: Prefect's own",
    )
    shared_filesystem: bool = Field(
        False,
        description="a local store.root that every Ray node mounts at the same path (NFS, Lustre); without it "
        "a local root is refused on a Ray cluster of more than one node (docs/cluster.md)",
    )

    compile_cache: str = Field(
        "off",
        description="where the workers keep torch.compile's caches between runs (inductor graphs, Triton kernels), "
        "so the first iteration on a fresh node skips compilation: off; store = {store.root}/compile_cache when a "
        "worker runs on CUDA (on CPU nothing large is compiled); or any fsspec folder URL. The cache is compiled "
        "code that torch unpickles: only a folder that no one but the run's owners can write",
    )

    @field_validator("root")
    @classmethod
    def _no_credentials(cls, value: str) -> str:
        return reject_credentials(value, "store.root")

    @field_validator("compile_cache")
    @classmethod
    def _cache_without_credentials(cls, value: str) -> str:
        return reject_credentials(value, "store.compile_cache")


class RayConfig(_Strict):
    address: Optional[str] = Field(None, description="Ray cluster address; None starts a local Ray")
    num_cpus: Optional[int] = Field(None, ge=1, description="CPUs of the local Ray (None = all)")


class DebugConfig(_Strict):
    """slime's debug flags, same names; here they select which parts of the worker group exist."""

    rollout_only: bool = Field(False, description="engines only: generate and persist, no trainer")
    train_only: bool = Field(False, description="trainer only: replay persisted rollouts, no engine")
    save_debug_rollout_data: Optional[str] = Field(
        None, description="also export slime .pt per rollout: a path template with {rollout_id}"
    )
    load_debug_rollout_data: Optional[str] = Field(
        None, description="replay slime .pt dumps: a path template with {rollout_id} (implies train_only)"
    )
    load_debug_rollout_data_subsample: Optional[float] = Field(
        None, gt=0, le=1, description="keep this fraction of prompt groups (first and last halves)"
    )
    dump_details: Optional[str] = Field(
        None, description="folder for rollout artifacts + per-token train dumps (log-probs, advantages)"
    )
    fail_after_iteration: Optional[int] = Field(
        None,
        ge=1,
        description="fault drill: rl_train fails right after committing this iteration's checkpoint, on "
        "the first attempt of its flow run only (exercises retry -> resume; off by default)",
    )
    check_weight_update_equal: bool = Field(
        False,
        description="SGLang engines, at startup: snapshot the engine's weights, randomise them, sync the "
        "trainer's, and require every tensor back bit for bit (the whole name mapping, fusing "
        "and sharding checked at once)",
    )
    serve_stale: bool = Field(
        False,
        description="fault drill (hf engine): the engine takes every weight update, so checksum parity "
        "passes, but keeps generating from its starting weights; the post-sync probe "
        "(watchdog.probe_every) must fail the sync (docs/checks.md; off by default)",
    )
    slow_train_s: float = Field(
        0.0,
        ge=0,
        description="fault drill (stall deadlines): every train call first spends this many seconds "
        "ticking its progress counter, a slow call the watchdog must leave alone, long "
        "enough that a SIGSTOP of the trainer lands inside it (docs/checks.md; 0 = off)",
    )

    @field_validator("save_debug_rollout_data", "load_debug_rollout_data")
    @classmethod
    def _template(cls, value: Optional[str], info) -> Optional[str]:
        if value is not None and "{rollout_id}" not in value:
            raise ValueError(
                f"template {value!r} has no {{rollout_id}} placeholder; e.g. /data/dump/data_{{rollout_id}}.pt"
            )
        return reject_credentials(value, f"debug.{info.field_name}")

    @field_validator("dump_details")
    @classmethod
    def _dump_no_credentials(cls, value: Optional[str]) -> Optional[str]:
        return reject_credentials(value, "debug.dump_details")


class WatchdogConfig(_Strict):
    """Checks a run makes on itself while it runs (docs/checks.md): stall deadlines, a probe after every
    weight sync, the trend of the train/rollout log-prob mismatch."""

    stall_s: float = Field(
        600.0,
        ge=0,
        description="seconds an actor call may go without progress (tokens generated, micro-batches "
        "trained, buckets sent) before the task is failed with every actor's stacks "
        "captured; 0 turns the deadline off",
    )
    probe_every: int = Field(
        1,
        ge=0,
        description="after every k-th weight sync the engine and the trainer score the same probe "
        "sequences and their log-probs must agree (0 = off)",
    )
    probe_prompts: int = Field(4, ge=1, description="probe sequences: the first k prompts of train rollout 0")
    probe_tokens: int = Field(
        16,
        ge=1,
        description="tokens each probe sequence continues for (at most "
        "rollout.max_new_tokens), sampled with a fixed seed",
    )
    probe_max_diff_fp32: float = Field(
        1e-3,
        gt=0,
        description="largest mean |engine - trainer| probe log-prob when both sides are fp32 (or fp64): "
        "generation vs teacher-forced numerics differ by ~1e-5 (docs/checks.md)",
    )
    probe_max_diff_bf16: float = Field(
        5e-2,
        gt=0,
        description="the same bound when either side is bf16; a default awaiting an H200 measurement (docs/checks.md)",
    )
    trend_window: int = Field(
        8,
        ge=0,
        description="iterations over which the slope of train/train_rollout_logprob_abs_diff is fitted "
        "(0 = off; checked once the window is full)",
    )
    trend_warn_slope: float = Field(
        5e-4, gt=0, description="slope (per iteration) of the mismatch above which a warning event is emitted"
    )
    trend_fail_slope: float = Field(
        2e-3, gt=0, description="slope (per iteration) of the mismatch above which the trend check fails the run"
    )

    @field_validator("trend_window")
    @classmethod
    def _window(cls, value: int) -> int:
        if value in (1, 2):
            raise ValueError(f"watchdog.trend_window={value}: a slope needs at least 3 iterations (0 turns it off)")
        return value

    @model_validator(mode="after")
    def _trend_bounds(self) -> "WatchdogConfig":
        if self.trend_fail_slope < self.trend_warn_slope:
            raise ValueError(
                f"watchdog.trend_fail_slope={self.trend_fail_slope:g} is below watchdog.trend_warn_slope="
                f"{self.trend_warn_slope:g}: the failure bound must be the higher one"
            )
        return self


TRACKING_BACKENDS = ("tensorboard", "mlflow", "wandb")


class TrackingConfig(_Strict):
    """Experiment tracking next to metrics.jsonl (flows/tracking.py); every backend is optional
    (`pip install 'rollflow[tracking]'`) and none is on by default."""

    backends: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(
        default_factory=list, description="any of tensorboard, mlflow, wandb (empty = metrics.jsonl only)"
    )
    project: str = Field("rollflow", description="W&B project (and the MLflow experiment unless `experiment` is set)")
    experiment: Optional[str] = Field(None, description="MLflow experiment name (default: `project`)")
    run_name: Optional[str] = Field(None, description="tracking run name (default: the rollflow run name)")
    uri: Optional[str] = Field(
        None,
        description="MLflow tracking URI: a server URL, sqlite:///path, or a local folder as a path or "
        "file:// URI (a SQLite store mlflow.db plus artifacts in it); default: the folder "
        "{store.root}/mlruns for a local store, ./mlruns otherwise",
    )
    dir: Optional[str] = Field(
        None,
        description="local folder for TensorBoard event files and W&B run files; default: "
        "{store.root}/{run}/ for a local store, ./rollflow-tracking/{run}/ otherwise",
    )
    wandb_mode: Optional[Literal["online", "offline"]] = Field(
        None, description="W&B mode (default: WANDB_MODE, else online); offline needs no account"
    )
    fatal: bool = Field(
        False,
        description="a tracking backend that errors, or cannot work (checked before any worker starts), fails "
        "the run (default: it is reported once and disabled, training goes on)",
    )

    @field_validator("backends")
    @classmethod
    def _unique(cls, value: list[str]) -> list[str]:
        return list(dict.fromkeys(value))

    @field_validator("uri")
    @classmethod
    def _uri_no_credentials(cls, value: Optional[str]) -> Optional[str]:
        return reject_credentials(value, "tracking.uri")


class RunConfig(_Strict):
    run: str = Field("demo", description="run name: the namespace of artifacts, checkpoints and actors")
    iterations: int = Field(12, ge=1, description="RL iterations (one rollout each)")
    checkpoint_every: int = Field(1, ge=1)
    eval_every: int = Field(0, ge=0, description="greedy eval every k iterations (0 = off)")
    resume: bool = Field(True, description="continue after the last committed checkpoint of this run")
    retries: int = Field(
        0,
        ge=0,
        le=100,
        description="flow-level retries of rl_train: each retry continues the same "
        "flow run from the last committed checkpoint",
    )
    timeout_s: Optional[float] = Field(None, gt=0, description="flow run timeout in seconds (None = no limit)")
    resume_from: Optional[int] = Field(
        None,
        ge=0,
        description="resume after this committed checkpoint instead of the latest (e.g. the latest "
        "one's payload is corrupt); later checkpoints are redone",
    )
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    algo: AlgoConfig = AlgoConfig()
    train: OptimConfig = OptimConfig()
    store: StoreConfig = StoreConfig()
    ray: RayConfig = RayConfig()
    placement: Literal["colocate", "disaggregated"] = Field(
        "disaggregated", description="colocate: trainer and engines share GPUs; disaggregated: separate GPUs"
    )
    offload: bool = Field(
        False,
        description="colocate only: engines release memory while the trainer runs, and the "
        "trainer's weights, grads and optimizer state go to host memory while "
        "the engine generates",
    )
    resources: ResourcesConfig = Field(
        default_factory=ResourcesConfig, description="GPU budget and layout (all 0 = CPU, no placement group)"
    )
    debug: DebugConfig = DebugConfig()
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig, description="TensorBoard / MLflow / W&B logging of the metrics (off by default)"
    )
    watchdog: WatchdogConfig = Field(
        default_factory=WatchdogConfig, description="stall deadlines and post-sync probes (docs/checks.md)"
    )
    pipeline: PipelineConfig = Field(
        default_factory=PipelineConfig,
        description="off-policy pipelining: async (one-step-off) training, partial "
        "rollouts, dynamic sampling (docs/async.md)",
    )
    _notices: list[str] = PrivateAttr(default_factory=list)

    @field_validator("run")
    @classmethod
    def _run_name(cls, value: str) -> str:
        # One rule for run names: the store's (it names folders under the root, and actors).
        return validate_run(value)

    @model_validator(mode="wrap")
    @classmethod
    def _implied_settings(cls, data: Any, handler: Any) -> "RunConfig":
        """Settings that other settings imply are applied to the input (a new dict; the caller's data is
        not touched) before validation, and reported in `notices`."""
        notices: list[str] = []
        if isinstance(data, dict):
            data = _with_implied_settings(cls, data, notices)
        cfg = handler(data)
        cfg._notices[:0] = notices
        return cfg

    @model_validator(mode="after")
    def _debug_modes(self) -> "RunConfig":
        debug = self.debug
        if debug.load_debug_rollout_data and not debug.train_only and debug.rollout_only:
            raise ValueError(
                "debug.load_debug_rollout_data replays saved rollouts (train only), which contradicts "
                "debug.rollout_only=true; drop one of them"
            )
        if debug.rollout_only and debug.train_only:
            raise ValueError(
                "debug.rollout_only and debug.train_only are both true: rollout-only runs no trainer and "
                "train-only runs no engine; set one of them"
            )
        if debug.load_debug_rollout_data_subsample is not None and not debug.train_only:
            raise ValueError(
                "debug.load_debug_rollout_data_subsample only applies when replaying saved rollouts "
                "(debug.load_debug_rollout_data or debug.train_only)"
            )
        if self.offload and self.placement != "colocate":
            raise ValueError("offload=true needs placement='colocate' (engines release memory for a colocated trainer)")
        return self

    @property
    def notices(self) -> list[str]:
        """Adjustments validation made (printed by the CLI so nothing changes silently)."""
        return list(self._notices)

    @model_validator(mode="after")
    def _cross_checks(self) -> "RunConfig":
        total = self.data.prompts_per_rollout * self.rollout.n_samples_per_prompt
        if self.train.num_steps_per_rollout > total:
            raise ValueError(
                f"train.num_steps_per_rollout={self.train.num_steps_per_rollout} exceeds the samples per rollout "
                f"(data.prompts_per_rollout * rollout.n_samples_per_prompt = {total})"
            )
        if self.algo.advantage_estimator == "rloo" and self.rollout.n_samples_per_prompt < 2:
            raise ValueError("algo.advantage_estimator='rloo' needs rollout.n_samples_per_prompt >= 2")
        if self.algo.advantage_estimator == "ppo":
            _check_ppo(self)
        elif self.resources.critic_gpus:
            raise ValueError(
                f"resources.critic_gpus={self.resources.critic_gpus} only applies to algo.advantage_estimator='ppo' "
                "(its critic); leave it at 0"
            )
        self._notices.extend(n for n in self.algo.implied if n not in self._notices)
        if self.algo.loss_agg_mode == "seq-mean-token-sum-norm" and self.algo.loss_norm_constant is None:
            # Dr. GRPO divides by the generation budget, a constant, not by the batch's padded width.
            self.algo.loss_norm_constant = self.rollout.max_new_tokens
            self._notices.append(f"algo.loss_norm_constant set to rollout.max_new_tokens={self.rollout.max_new_tokens}")
        return self

    @model_validator(mode="after")
    def _resources_and_sglang(self) -> "RunConfig":
        # The GPU budget fails here, at config time, with the arithmetic (infra/placement.py).
        plan_placement(
            self.placement,
            self.resources,
            train=not self.debug.rollout_only,
            rollout=not self.debug.train_only,
            critic=self.algo.advantage_estimator == "ppo",
        )
        if self.rollout.engine != "sglang" and self.resources.num_engines > 1:
            raise ValueError(
                f"resources.num_engines={self.resources.num_engines} with rollout.engine="
                f"{self.rollout.engine!r}: the in-process engine runs once per run; use "
                "rollout.engine='sglang' for several engines, or resources.num_engines=1"
            )
        if self.rollout.engine == "sglang":
            sg = self.rollout.sglang
            gpe = self.resources.gpus_per_engine
            if sg.tp_size and gpe and sg.tp_size != gpe:
                raise ValueError(
                    f"rollout.sglang.tp_size={sg.tp_size} differs from resources.gpus_per_engine={gpe}: "
                    "an engine's tensor parallel size is its GPU count; set one of them"
                )
            if sg.tp_size is None and gpe > 1:
                sg.tp_size = gpe
                self._notices.append(f"rollout.sglang.tp_size set to resources.gpus_per_engine={gpe}")
            if sg.dtype is None and self.rollout.dtype == "float64":
                raise ValueError(
                    "rollout.dtype='float64' is not an SGLang dtype; set rollout.dtype or rollout.sglang.dtype"
                )
            _sglang_dtype_and_memory(self)
            if self.offload and not sg.memory_saver:
                sg.memory_saver = True
                self._notices.append("offload=true: rollout.sglang.memory_saver turned on (--enable-memory-saver)")
            if sg.weight_sync == "auto":
                sg.weight_sync = sg.resolved_weight_sync(self.placement)
                self._notices.append(
                    f"rollout.sglang.weight_sync=auto -> {sg.weight_sync!r} (placement={self.placement})"
                )
        else:
            _hf_weight_sync(self)
        return self

    @model_validator(mode="after")
    def _logprobs_and_seeds(self) -> "RunConfig":
        """rollout.logprobs='teacher_forced' promises bitwise equal log-probs: refuse what cannot keep it."""
        if self.rollout.logprobs == "teacher_forced":
            ro, tr = self.rollout, self.train
            if tr.backend != "torch":
                raise ValueError(
                    f"rollout.logprobs='teacher_forced' needs train.backend='torch' (got {tr.backend!r}: "
                    "the engine can only rerun the torch trainer's forward); set rollout.logprobs='engine'"
                )
            if ro.dtype != tr.dtype:
                raise ValueError(
                    f"rollout.logprobs='teacher_forced' needs rollout.dtype == train.dtype (got "
                    f"{ro.dtype!r} and {tr.dtype!r}); set rollout.dtype={tr.dtype!r}"
                )
            if _device_type(ro.device) != _device_type(tr.device):
                raise ValueError(
                    f"rollout.logprobs='teacher_forced' needs rollout.device and train.device of one type "
                    f"(got {ro.device!r} and {tr.device!r}); set rollout.device={tr.device!r}"
                )
        return self

    @model_validator(mode="after")
    def _megatron_layout(self) -> "RunConfig":
        """train.megatron.{tp, pp, cp} against the trainer ranks (one per trainer GPU), before any worker starts."""
        if self.train.backend == "megatron" and not self.debug.rollout_only:
            world = max(1, self.resources.trainer_gpus)
            m = self.train.megatron
            try:
                dp = m.data_parallel_size(world)
            except ValueError as exc:
                raise ValueError(f"{exc} (resources.trainer_gpus={self.resources.trainer_gpus})") from None
            sharded = world > 1 and (
                m.model_parallel_size > 1 or m.vpp is not None or (m.use_distributed_optimizer and dp > 1)
            )
            layout = f"train.megatron tp={m.tp} pp={m.pp} cp={m.cp} vpp={m.vpp} over {world} trainer GPUs"
            if sharded and "://" in self.store.root and not self.store.root.startswith("file://"):
                raise ValueError(
                    f"{layout} writes Megatron's distributed checkpoints from every rank to a shared "
                    f"filesystem; store.root={self.store.root!r} is an object store. Use a path every "
                    "trainer host can write (local disk on one host, NFS / Lustre across hosts)"
                )
        return self

    @model_validator(mode="after")
    def _lora(self) -> "RunConfig":
        _check_lora(self)
        return self

    @model_validator(mode="after")
    def _moe(self) -> "RunConfig":
        _check_moe(self)
        return self

    @model_validator(mode="after")
    def _pipeline(self) -> "RunConfig":
        _check_pipeline(self)
        return self

    def scoring_layout(self) -> Optional[ScoringLayout]:
        """What the hf engine needs to rescore rollouts as the trainer scores them (rollout.logprobs=
        'teacher_forced'); None otherwise."""
        if self.rollout.logprobs != "teacher_forced":
            return None
        return ScoringLayout.of(self.train)

    def compile_cache_uri(self) -> Optional[str]:
        """store.compile_cache resolved: the folder the workers load and save torch.compile's caches in, or None."""
        chosen = self.store.compile_cache
        if chosen == "off":
            return None
        if chosen != "store":
            return chosen
        on_cuda = self.rollout.device.startswith("cuda") or self.train.device.startswith("cuda")
        return f"{self.store.root.rstrip('/')}/compile_cache" if on_cuda else None

    def config_hash(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]

    def train_hash(self) -> str:
        """Hash of what changes training results (not the run name, iteration count or store)."""
        part = {
            "model": self.model.model_dump(),
            "algo": self.algo.model_dump(),
            "train": self.train.model_dump(),
            "temperature": self.rollout.temperature,
        }
        return hashlib.sha256(json.dumps(part, sort_keys=True).encode()).hexdigest()[:16]


def _hf_weight_sync(cfg: RunConfig) -> None:
    """The hf engine takes the trainer's GPU tensors by CUDA IPC only where both share a GPU (placement=colocate)."""
    ro = cfg.rollout
    cuda = ro.device.startswith("cuda")
    if ro.hf_weight_sync == "auto":
        ro.hf_weight_sync = resolve_hf_weight_sync("auto", ro.device, cfg.placement)
        if ro.hf_weight_sync == "tensor":
            cfg._notices.append("rollout.hf_weight_sync=auto -> 'tensor' (placement=colocate on CUDA: no host staging)")
    elif ro.hf_weight_sync == "tensor" and cuda and cfg.placement != "colocate":
        raise ValueError(
            "rollout.hf_weight_sync='tensor' with placement='disaggregated': the engine would open CUDA IPC handles "
            "to the trainer's GPU, which it does not share; set placement='colocate' or "
            "rollout.hf_weight_sync='object_store'"
        )


def _sglang_dtype_and_memory(cfg: RunConfig) -> None:
    """SGLang engines' dtype (bf16 unless set) and, colocated, their static memory share (tasks/rollout/
    sglang/config.py says why)."""
    sg = cfg.rollout.sglang
    if sg.dtype is None:
        sg.dtype = engine_dtype(cfg.rollout)
        cfg._notices.append(f"rollout.sglang.dtype set to {sg.dtype!r} (SGLang engines' default)")
    if sg.dtype not in ("auto", cfg.train.dtype):
        cfg._notices.append(
            f"SGLang engines run {sg.dtype} while the trainer runs {cfg.train.dtype}: rollout log-probs "
            f"carry {sg.dtype} rounding (see train/train_rollout_logprob_abs_diff); set "
            f"rollout.sglang.dtype={cfg.train.dtype!r} to match"
        )
    if cfg.placement == "colocate" and not cfg.debug.rollout_only and not cfg.debug.train_only and not sg.urls:
        fraction = colocated_mem_fraction(sg)
        if sg.mem_fraction_static is None:
            sg.mem_fraction_static = fraction
            cfg._notices.append(
                f"rollout.sglang.mem_fraction_static set to {fraction:g} (placement=colocate: the "
                f"trainer keeps rollout.sglang.colocate_trainer_fraction={sg.colocate_trainer_fraction:g})"
            )


def _check_ppo(cfg: RunConfig) -> None:
    """ppo runs a critic actor beside the trainer (flows/group.py); what this build cannot run with it.

    The critic is a torch model in its own actor whatever train.backend says (docs/architecture.md section
    8): it needs no log-prob alignment with the engine and no weight sync, so the megatron policy
    trainer and a GPU placement take it as it is (resources.critic_gpus places it)."""
    if cfg.debug.train_only and cfg.debug.load_debug_rollout_data_subsample is not None:
        raise ValueError(
            "algo.advantage_estimator='ppo' cannot replay a subsample "
            f"(debug.load_debug_rollout_data_subsample={cfg.debug.load_debug_rollout_data_subsample}): the "
            "critic's GAE covers whole rollouts; drop the subsample"
        )
    if cfg.resources.critic_gpus and not cfg.resources.uses_gpus:
        raise ValueError(
            "resources.critic_gpus=1 without GPUs (resources.num_gpus=0): ppo's critic then runs on "
            "train.device; set resources.critic_gpus=0 or give the run GPUs"
        )


def _check_lora(cfg: RunConfig) -> None:
    """model.lora: what the LoRA trainer (tasks/train/lora_backend.py) cannot do, and peft present where it trains;
    rollout.sglang.lora_sync=adapter: what SGLang's LoRA adapter API needs."""
    sg = cfg.rollout.sglang
    if sg.lora_sync == "adapter":
        _check_lora_adapter_sync(cfg)
    if cfg.model.lora is None:
        return
    if cfg.train.backend != "torch":
        raise ValueError(LORA_BACKEND_REFUSED)
    if cfg.rollout.logprobs == "teacher_forced":
        raise ValueError(
            "model.lora with rollout.logprobs='teacher_forced': the engine scores with merged weights and the "
            "trainer with W x + B A x, so log-probs cannot be bitwise equal; set rollout.logprobs='engine'"
        )
    if not cfg.debug.rollout_only and not peft_available():
        raise ValueError(PEFT_MISSING)
    if cfg.rollout.engine == "sglang" and sg.lora_sync == "merged":
        cfg._notices.append(
            "model.lora with rollout.engine='sglang': the engines get merged weights through "
            "rollout.sglang.weight_sync; rollout.sglang.lora_sync=adapter sends only the adapter "
            "(SGLang's LoRA adapter API)"
        )


def _check_lora_adapter_sync(cfg: RunConfig) -> None:
    notice = check_lora_adapter_sync(cfg.rollout.sglang, cfg.model.lora, cfg.rollout.engine, cfg.placement)
    cfg._notices.append(notice)


def _check_moe(cfg: RunConfig) -> None:
    """MoE models run on the hf engine and the torch trainer; routing replay needs an MoE model there."""
    model_type = model_type_of(cfg.model.path)
    moe = model_type in MOE_MODEL_TYPES
    if moe and cfg.train.backend == "megatron" and not cfg.debug.rollout_only:
        raise ValueError(
            f"model.path={cfg.model.path!r} is an MoE model ({model_type}): the megatron backend has no HF "
            "conversion of its experts yet; set train.backend='torch'"
        )
    if not cfg.algo.routing_replay:
        return
    if not moe:
        raise ValueError(
            f"algo.routing_replay=true needs an MoE model; model.path={cfg.model.path!r} is "
            f"{model_type or 'not readable'!r}: set algo.routing_replay=false"
        )
    if cfg.rollout.engine != "hf" or cfg.train.backend != "torch":
        raise ValueError(
            "algo.routing_replay=true runs on rollout.engine='hf' with train.backend='torch' (got "
            f"{cfg.rollout.engine!r} / {cfg.train.backend!r}); set those or algo.routing_replay=false"
        )
    if cfg.rollout.function != "single_turn":
        raise ValueError(
            f"algo.routing_replay=true records routes in the single_turn rollout only; rollout.function="
            f"{cfg.rollout.function!r} builds its samples itself; set rollout.function='single_turn'"
        )
    static = cfg.rollout.static_cache
    if static is True or (static == "auto" and _device_type(cfg.rollout.device) == "cuda"):
        raise ValueError(
            "algo.routing_replay=true records routes in transformers' generate, not the static-cache decoder "
            f"(rollout.static_cache={static!r} on rollout.device={cfg.rollout.device!r}); "
            "set rollout.static_cache=false"
        )


def _check_pipeline(cfg: RunConfig) -> None:
    """What async training (pipeline.max_staleness > 0) and partial rollouts need."""
    pipe = cfg.pipeline
    if pipe.partial_rollout and pipe.max_staleness < 2:
        raise ValueError(
            f"pipeline.partial_rollout=true needs pipeline.max_staleness >= 2 (got {pipe.max_staleness}): "
            "a continued sample keeps tokens two weight versions old; set pipeline.max_staleness=2"
        )
    if cfg.algo.advantage_estimator == "ppo" and (pipe.partial_rollout or pipe.dynamic_sampling.enabled):
        raise ValueError(
            "algo.advantage_estimator='ppo' scores whole rollouts with its critic; it cannot drop filtered "
            "groups: set pipeline.partial_rollout=false and pipeline.dynamic_sampling.enabled=false"
        )
    _resolve_off_policy_correction(cfg)
    if pipe.stale_policy == "wait" and not pipe.partial_rollout:
        # 'drop' is the default, which a form or a dump carries whether or not the user chose it: no notice for it
        cfg._notices.append(
            f"pipeline.stale_policy={pipe.stale_policy!r} has nothing to act on without partial rollouts: the "
            f"lock-step queue never holds a sample older than pipeline.max_staleness={pipe.max_staleness} (the "
            "generator waits for the trainer); it applies to cut groups when pipeline.partial_rollout=true"
        )
    if not pipe.pipelined:
        return
    if cfg.debug.train_only:
        # A replay trains on the async run's committed rollouts, as the run trained on them: its config (and so its
        # off-policy correction) is the run's; only the pipelining has nothing to do.
        cfg._notices.append(
            f"pipeline.max_staleness={pipe.max_staleness} has no effect in a replay (no engine); its off-policy "
            f"correction (algo.use_tis={cfg.algo.use_tis}) is kept, so the replay trains as the run did"
        )
        return
    if cfg.watchdog.trend_window and not cfg.watchdog.probe_every:
        cfg._notices.append(
            f"pipeline.max_staleness={pipe.max_staleness} with watchdog.probe_every=0: an async run's mismatch "
            "trend follows the post-sync probe (its train/rollout gap holds the policy's own move), so the trend "
            "check sees nothing; set watchdog.probe_every >= 1 to keep it"
        )
    if cfg.placement == "colocate":
        raise ValueError(
            f"pipeline.max_staleness={pipe.max_staleness} needs placement='disaggregated': colocated "
            "engines and trainer share GPUs and cannot run at the same time; set placement=disaggregated "
            "or pipeline.max_staleness=0"
        )
    if cfg.debug.rollout_only:
        raise ValueError(
            f"pipeline.max_staleness={pipe.max_staleness} pipelines generate and train; debug.rollout_only "
            "runs generation alone; set pipeline.max_staleness=0"
        )


def _resolve_off_policy_correction(cfg: RunConfig) -> None:
    """algo.use_tis unset: on for an off-policy run (its tokens come from weights up to max_staleness versions
    old), off otherwise; the notice names what was taken."""
    algo, pipe = cfg.algo, cfg.pipeline
    if algo.use_tis is not None:
        return
    on = pipe.pipelined and not algo.use_rollout_logprobs
    algo.use_tis = on
    if on:
        cfg._notices.append(
            f"algo.use_tis=true (pipeline.max_staleness={pipe.max_staleness}: tokens up to {pipe.max_staleness} "
            f"weight version{'s' if pipe.max_staleness > 1 else ''} old): importance weights against the engine's "
            f"log-probs, algo.tis_level={algo.tis_level!r}, algo.tis_mode={algo.tis_mode!r}, "
            f"algo.tis_upper_bound={algo.tis_upper_bound:g}; set algo.use_tis=false to train without them"
        )


def _device_type(device: str) -> str:
    """'cuda:1' -> 'cuda' (the kernels, and so the numerics, depend on the device type)."""
    return device.split(":", 1)[0].strip().lower()


def _with_implied_settings(cls: type[RunConfig], data: dict[str, Any], notices: list[str]) -> dict[str, Any]:
    """`data` with what its debug flags imply (a new dict when anything changes):

    - `debug.load_debug_rollout_data` replays saved rollouts: `debug.train_only` (no engine);
    - `debug.rollout_only` has nothing to share GPUs with or to offload for: placement 'disaggregated',
      offload off.

    Invalid values are left alone: validation then reports them with their field names."""
    try:
        raw_debug = data.get("debug")
        debug = DebugConfig.model_validate({} if raw_debug is None else raw_debug)
        placement = TypeAdapter(cls.model_fields["placement"].annotation).validate_python(
            data.get("placement", cls.model_fields["placement"].default)
        )
        offload = TypeAdapter(bool).validate_python(data.get("offload", cls.model_fields["offload"].default))
    except ValidationError:
        return data
    updates: dict[str, Any] = {}
    if debug.load_debug_rollout_data and not debug.train_only and not debug.rollout_only:
        updates["debug"] = debug.model_copy(update={"train_only": True})
        notices.append("debug.load_debug_rollout_data set: debug.train_only turned on (no engine)")
    if debug.rollout_only and (placement == "colocate" or offload):
        updates.update(placement="disaggregated", offload=False)
        notices.append("debug.rollout_only: placement set to 'disaggregated' and offload turned off")
    return {**data, **updates} if updates else data
