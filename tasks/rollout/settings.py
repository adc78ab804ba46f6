"""Typed, validated settings of the rollout side (sections of flows' RunConfig)."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollflow.artifacts.storage import redact_url
from rollflow.tasks.rollout.addition import addition_prompts
from rollflow.tasks.rollout.agent import resolve_rollout_fn
from rollflow.tasks.rollout.agent_settings import AgentConfig, FeedbackConfig
from rollflow.tasks.rollout.dataset import eval_items, train_items
from rollflow.tasks.rollout.engine import SamplingParams
from rollflow.tasks.rollout.prompts import PromptItem
from rollflow.tasks.rollout.rewards import resolve_reward_fn
from rollflow.tasks.rollout.sglang.config import SGLangConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _absolute_local(path: Optional[str]) -> Optional[str]:
    """Local paths made absolute (Ray workers may run in another directory); URLs unchanged."""
    if path is None or "://" in path:
        return path
    import os

    return os.path.abspath(os.path.expanduser(path))


class EvalDataConfig(_Strict):
    """The eval set and its own sampling (data.eval). Records use data's keys, template and system prompt."""

    path: Optional[str] = Field(
        None,
        description="JSONL / parquet eval set (local path or fsspec URL); "
        "task='addition' draws its eval prompts without one",
    )
    format: Literal["auto", "jsonl", "parquet"] = "auto"
    max_prompts: Optional[int] = Field(None, ge=1, description="use the first N records (None = all)")
    n_samples_per_prompt: int = Field(1, ge=1, description="samples per eval prompt (pass@k needs k <= n)")
    temperature: float = Field(0.0, ge=0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: Optional[int] = Field(None, ge=1, description="None = rollout.max_new_tokens")
    pass_k: list[int] = Field(default_factory=lambda: [1], description="report eval/pass@k for these k")
    pass_threshold: float = Field(1.0, description="a sample counts as correct when its reward >= this")

    @field_validator("path")
    @classmethod
    def _absolute(cls, value: Optional[str]) -> Optional[str]:
        return _absolute_local(value)

    @model_validator(mode="after")
    def _k_le_n(self) -> "EvalDataConfig":
        bad = [k for k in self.pass_k if not 1 <= k <= self.n_samples_per_prompt]
        if bad:
            raise ValueError(
                f"data.eval.pass_k={self.pass_k}: every k must be in 1..n_samples_per_prompt="
                f"{self.n_samples_per_prompt} (the unbiased estimator needs n >= k samples)"
            )
        return self


class DataConfig(_Strict):
    task: Literal["addition", "dataset"] = Field(
        "addition", description="'addition': the built-in synthetic task; 'dataset': prompts from data.path"
    )
    digits: int = Field(3, ge=1, le=9)
    prompts_per_rollout: int = Field(256, ge=1, description="prompts (groups) per rollout")
    eval_prompts: int = Field(256, ge=1, description="task='addition': prompts of the eval split")
    seed: int = Field(0, description="addition: prompt seed; dataset: shuffle seed (epoch e uses seed and e)")
    path: Optional[str] = Field(None, description="task='dataset': JSONL or parquet file, local or any fsspec URL")
    format: Literal["auto", "jsonl", "parquet"] = Field("auto", description="auto: from the file name")
    input_key: str = Field("prompt", description="record field with the prompt text (or chat messages)")
    label_key: Optional[str] = Field("label", description="record field with the reference answer (null: none)")
    metadata_keys: list[str] = Field(default_factory=list, description="record fields copied into Sample.metadata")
    apply_chat_template: bool = Field(False, description="render prompts with the tokenizer's chat template")
    system_prompt: Optional[str] = Field(None, description="system message (chat) or text prepended to prompts")
    shuffle: bool = Field(True, description="a fresh order every epoch, seeded by (seed, epoch)")
    epochs: Optional[int] = Field(None, ge=1, description="passes over the data (None = no limit)")
    eval: Optional[EvalDataConfig] = Field(None, description="eval set and its sampling settings")

    @field_validator("path")
    @classmethod
    def _absolute(cls, value: Optional[str]) -> Optional[str]:
        return _absolute_local(value)

    @model_validator(mode="after")
    def _task_fields(self) -> "DataConfig":
        if self.task == "dataset" and not self.path:
            raise ValueError("data.task='dataset' needs data.path (a .jsonl or .parquet file, local or fsspec URL)")
        if self.task == "addition" and self.path:
            raise ValueError(
                f"data.path={self.path!r} is set but data.task='addition' ignores it; set data.task='dataset'"
            )
        if self.task == "dataset" and self.eval is not None and not self.eval.path:
            raise ValueError("data.eval needs data.eval.path for data.task='dataset'")
        return self

    @property
    def eval_n_samples(self) -> int:
        """Samples per prompt of the eval split (1 unless data.eval says otherwise)."""
        return self.eval.n_samples_per_prompt if self.eval is not None else 1


class RemoteRewardConfig(_Strict):
    """rollout.reward = 'http(s)://...': POST {prompt, response, label, metadata} per sample."""

    timeout_s: float = Field(30.0, gt=0, description="per request")
    retries: int = Field(2, ge=0, description="retries on connection errors, timeouts and HTTP 5xx / 429")
    backoff_s: float = Field(0.5, ge=0, description="first retry delay; doubles per retry")
    max_concurrency: int = Field(32, ge=1, description="requests in flight at once")
    auth_env: Optional[str] = Field(None, description="environment variable whose value is sent as a Bearer token")


class RolloutConfig(_Strict):
    engine: Literal["hf", "sglang"] = "hf"
    n_samples_per_prompt: int = Field(8, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 = no top-k (full softmax)")
    max_new_tokens: int = Field(5, ge=1)
    reward: str = Field(
        "addition",
        description="built-in (addition, exact_match, math, f1), dotted path "
        "'pkg.mod:fn', or an http(s) URL of a reward server",
    )
    reward_key: Optional[str] = Field(
        None, description="field of a dict reward used for training and metrics (slime's --reward-key)"
    )
    eval_reward_key: Optional[str] = Field(
        None, description="field of a dict reward for the eval split (slime's --eval-reward-key; default reward_key)"
    )
    reward_scope: Literal["sample", "group"] = Field(
        "sample", description="group: the function gets the samples of one prompt and returns their rewards"
    )
    remote_reward: RemoteRewardConfig = Field(default_factory=RemoteRewardConfig)
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    device: str = "cpu"
    threads: int = Field(1, ge=1)
    max_batch_size: int = Field(4096, ge=1)
    static_cache: Union[bool, Literal["auto"]] = Field(
        "auto",
        description="hf engine: transformers' static KV cache with its compiled decode step; "
        "auto = on for CUDA, off on CPU",
    )
    hf_weight_sync: Literal["auto", "object_store", "tensor"] = Field(
        "auto",
        description="hf engine: how the trainer's weights reach it. object_store = the whole model as host copies "
        "through Ray's object store; tensor = bucket by bucket as the trainer makes them, CUDA tensors as IPC "
        "handles to the trainer's GPU memory (no host staging; needs placement=colocate on CUDA: a handle opens "
        "only on its own GPU); auto = tensor when placement=colocate and rollout.device is CUDA, else object_store",
    )
    seed: int = Field(
        0,
        description="sampling seed of a rollout: seed * 1000003 + rollout_id (per call; samples "
        "of a group draw different numbers)",
    )
    logprobs: Literal["engine", "teacher_forced"] = Field(
        "engine",
        description="rollout log-probs: 'engine' = taken while sampling (up to ~1e-5 off the trainer's in fp32, "
        "~1e-2 in bf16); 'teacher_forced' = the hf engine rescoring each rollout with the torch "
        "trainer's own forward (same padding, positions, micro-batches, dtype), so train-vs-"
        "rollout log-probs are bitwise equal; costs one extra forward per rollout",
    )
    sglang: SGLangConfig = Field(default_factory=SGLangConfig, description="engine='sglang' only: server settings")
    function: str = Field(
        "single_turn",
        description="rollout function: 'single_turn' (one batched generate per "
        "rollout) or a dotted path 'pkg.mod:fn' (multi-turn agents, "
        "tools; docs/agents.md)",
    )
    agent: AgentConfig = Field(default_factory=AgentConfig, description="limits of rollout.function's conversations")
    feedback: FeedbackConfig = Field(
        default_factory=FeedbackConfig, description="rollout.reward='conversation_feedback' only: the judge"
    )

    @field_validator("function")
    @classmethod
    def _function_importable(cls, value: str) -> str:
        if value != "single_turn":
            resolve_rollout_fn(value)  # ValueError naming rollout.function and what is wrong
        return value

    @field_validator("reward")
    @classmethod
    def _reward_url_without_credentials(cls, value: str) -> str:
        # The config travels as Prefect parameters and into logs: a token in the URL would be stored there.
        if "://" in value:
            if redact_url(value) != value:
                raise ValueError(
                    f"rollout.reward={redact_url(value)!r} carries credentials (user:secret@ or a token query "
                    "parameter); put the token in an environment variable and name it in "
                    "rollout.remote_reward.auth_env"
                )
        return value

    @model_validator(mode="after")
    def _logprobs_and_seeds(self) -> "RolloutConfig":
        if self.logprobs == "teacher_forced" and self.engine != "hf":
            raise ValueError(
                f"rollout.logprobs='teacher_forced' needs rollout.engine='hf' (the {self.engine} engine "
                "cannot run the trainer's forward); set rollout.logprobs='engine'"
            )
        if self.logprobs == "teacher_forced" and self.function != "single_turn":
            raise ValueError(
                f"rollout.logprobs='teacher_forced' rescores one engine call per sample, but "
                f"rollout.function={self.function!r} makes several; set rollout.logprobs='engine'"
            )
        if self.reward == "conversation_feedback" and not self.feedback.judge:
            raise ValueError(
                "rollout.reward='conversation_feedback' needs a judge: set rollout.feedback.judge to a "
                "dotted path 'pkg.mod:judge' (docs/agents.md)"
            )
        if self.feedback.judge:
            try:
                resolve_reward_fn(self.feedback.judge)
            except ValueError as exc:
                raise ValueError(str(exc).replace("rollout.reward=", "rollout.feedback.judge=", 1)) from None
        # seeded + native n is fine: the SGLang engine sends a prompt's n samples with n seeds (one batch
        # request), since SGLang's own `n` copies one sampling_seed to all n (identical samples)
        return self

    def reward_key_for(self, split: str) -> Optional[str]:
        """The dict-reward field of `split`, as slime: eval uses eval_reward_key, falling back to reward_key."""
        return (self.eval_reward_key or self.reward_key) if split == "eval" else self.reward_key

    def sampling(self, rollout_id: int, *, greedy: bool = False) -> SamplingParams:
        return SamplingParams(
            temperature=0.0 if greedy else self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_new_tokens,
            seed=self.seed * 1_000_003 + rollout_id,
        )

    def eval_sampling(self, data: DataConfig, rollout_id: int) -> SamplingParams:
        """The eval split's sampling: data.eval's settings (greedy, one sample, without an eval section)."""
        ev = data.eval
        if ev is None:
            return self.sampling(rollout_id, greedy=True)
        return SamplingParams(
            temperature=ev.temperature,
            top_p=ev.top_p,
            top_k=self.top_k,
            max_new_tokens=ev.max_new_tokens or self.max_new_tokens,
            seed=self.seed * 1_000_003 + EVAL_SEED_OFFSET + rollout_id,
        )


EVAL_SEED_OFFSET = 1_000_000


def prompts_for(data: DataConfig, rollout_id: int, split: str = "train") -> list[PromptItem]:
    """The prompts of one rollout, a pure function of (data config, rollout id, split).

    task='dataset' reads data.path in epochs whose order depends only on (seed, epoch): see
    tasks/rollout/dataset.py; the eval split is the whole eval set, in file order.
    """
    if data.task == "dataset":
        return eval_items(data) if split == "eval" else train_items(data, rollout_id)
    if split == "eval":
        return addition_prompts(data.eval_prompts, seed=data.seed + EVAL_SEED_OFFSET, digits=data.digits)
    return addition_prompts(data.prompts_per_rollout, seed=data.seed + rollout_id, digits=data.digits)


def resolve_hf_weight_sync(chosen: str, device: str, placement: str) -> str:
    """rollout.hf_weight_sync=auto made concrete: the trainer's GPU buckets by CUDA IPC (tensor) only where engine and
    trainer share a GPU (placement=colocate on CUDA), else the object store; an explicit choice stays."""
    if chosen != "auto":
        return chosen
    return "tensor" if device.startswith("cuda") and placement == "colocate" else "object_store"
