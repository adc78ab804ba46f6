"""rollout.logprobs='teacher_forced' (issue 18 item 7): the hf engine rescoring its samples with the torch
trainer's own forward, so train-vs-rollout log-probs are bitwise equal; and the deterministic-seed trap
(identical samples in a group) guarded.

The `cuda` cases run on a CUDA box only (the lead runs them on the H200):
    source scripts/use_checkout.sh && python3 -m pytest -q -p no:cacheprovider tests/test_teacher_forced.py -k cuda
They need torch, transformers and pydantic, no Prefect and no Ray.
"""

from __future__ import annotations

import logging

import pytest
import torch

from rollflow.tasks.groups import identical_group_fraction, identical_groups
from rollflow.tasks.model.dtypes import DTYPES as TORCH_DTYPES
from rollflow.tasks.model.source import resolve_model_path
from rollflow.tasks.model.teacher_forced import ScoringLayout, right_padded
from rollflow.tasks.model.tiny import load_model
from rollflow.tasks.rollout.engine import GenerationOutput, GenerationRequest, SamplingParams, sample_seed
from rollflow.tasks.rollout.generate import generate_samples
from rollflow.tasks.rollout.rewards import reward_fn_from_config, score_samples
from rollflow.tasks.rollout.settings import DataConfig, RolloutConfig
from rollflow.tasks.rollout.worker import RolloutWorker
from rollflow.tasks.train.batch import batch_from_samples
from rollflow.tasks.train.settings import AlgoConfig, OptimConfig
from rollflow.tasks.train.step import prepare_batch, train_on_samples
from rollflow.tasks.train.torch_backend import TorchBackend

MODEL = "builtin:addition"
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=CUDA)]
# bf16 on CPU works for the tiny model; the H200 case covers the dtype the GPU runs use
DTYPES = ["float32", "bfloat16"]

# mismatch/* figures that measure a distance (exactly 0 when the log-probs are bitwise equal) and the
# ratios (exactly 1); whichever of them the train step reports
ZERO_WHEN_EQUAL = (
    "train/train_rollout_logprob_abs_diff",
    "mismatch/log_ppl_diff",
    "mismatch/log_ppl_abs_diff",
    "mismatch/kl",
    "mismatch/k3_kl",
    "mismatch/chi2_token",
    "mismatch/chi2_seq",
    "mismatch/max_abs_log_ratio",
    "mismatch/log_ratio_clampfrac",
)
ONE_WHEN_EQUAL = ("mismatch/ppl_ratio", "mismatch/tis", "mismatch/ess_token", "mismatch/ess_seq")


def build_backend(model_spec: str, optim: OptimConfig, *, temperature: float) -> TorchBackend:
    """tasks/train/worker.py's torch path, without its artifact-store imports (pyarrow: the GPU box may lack it)."""
    model = load_model(resolve_model_path(model_spec), dtype=TORCH_DTYPES[optim.dtype], device=optim.device)
    return TorchBackend(model, optim, temperature=temperature)


def _setup(
    device: str,
    dtype: str,
    *,
    logprobs: str = "teacher_forced",
    micro_batch_size: int = 16,
    prompts: int = 16,
    n: int = 4,
):
    rollout = RolloutConfig(logprobs=logprobs, dtype=dtype, device=device, n_samples_per_prompt=n)
    optim = OptimConfig(dtype=dtype, device=device, micro_batch_size=micro_batch_size, num_steps_per_rollout=1)
    worker = RolloutWorker(
        MODEL,
        rollout,
        DataConfig(prompts_per_rollout=prompts),
        scoring=ScoringLayout.of(optim) if logprobs == "teacher_forced" else None,
    )
    backend = build_backend(MODEL, optim, temperature=rollout.temperature or 1.0)
    samples = score_samples(worker.rollout(0), reward_fn_from_config(rollout))
    return rollout, worker, backend, samples


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_teacher_forced_rollout_log_probs_equal_the_trainers_bitwise(device, dtype):
    # 64 samples in micro-batches of 16: the engine must split the rollout exactly as the trainer does
    rollout, worker, backend, samples = _setup(device, dtype)
    assert worker.describe().logprobs == "teacher_forced"
    batch = batch_from_samples(samples, group_size=rollout.n_samples_per_prompt)
    train_lp = backend.compute_log_probs(batch, "policy")
    on = batch.response_mask > 0
    assert torch.equal(train_lp[on], batch.rollout_log_probs[on])
    # ... and every mismatch figure of the first train step is exact
    result = train_on_samples(backend, samples, AlgoConfig(), group_size=rollout.n_samples_per_prompt)
    assert any(key in result.metrics for key in ZERO_WHEN_EQUAL)
    for key in ZERO_WHEN_EQUAL:
        if key in result.metrics:
            assert result.metrics[key] == 0.0, key
    for key in ONE_WHEN_EQUAL:
        if key in result.metrics:
            assert result.metrics[key] == 1.0, key


def test_bitwise_survives_the_artifact_round_trip(tmp_path):
    """What rl_iteration does between the engine and the trainer: persist, then load (parquet, float64)."""
    from rollflow.artifacts.manifest import EngineInfo
    from rollflow.artifacts.store import RolloutStore

    rollout, _, backend, samples = _setup("cpu", "float32")
    store = RolloutStore(str(tmp_path))
    ref = store.write(
        "tf",
        "train",
        0,
        samples,
        n_samples_per_prompt=rollout.n_samples_per_prompt,
        engine=EngineInfo(backend="hf", model=MODEL, weight_version=0),
        config_hash="x",
    )
    artifact = store.load_uri(ref.uri)
    # both of the trainer's batch builders: from Sample objects, and (when the store has it) from the columns
    sources = [artifact.samples] + ([artifact.columns] if hasattr(artifact, "columns") else [])
    for source in sources:
        batch, _ = prepare_batch(backend, source, AlgoConfig(), group_size=rollout.n_samples_per_prompt)
        on = batch.response_mask > 0
        assert torch.equal(batch.log_probs[on], batch.rollout_log_probs[on]), type(source).__name__


@pytest.mark.parametrize("device", DEVICES)
def test_with_use_rollout_logprobs_the_trainer_skips_its_own_pass_and_lands_on_the_same_weights(device):
    """teacher_forced already ran the trainer's scoring forward in the engine: algo.use_rollout_logprobs=true takes
    those log-probs as the old ones instead of scoring the batch again, and the update is bit for bit the same."""
    rollout, _, recomputing, samples = _setup(device, "float32")
    reusing = build_backend(MODEL, recomputing.optim_cfg, temperature=rollout.temperature or 1.0)
    for name, tensor in reusing.model.state_dict().items():
        assert torch.equal(tensor, recomputing.model.state_dict()[name])  # the same start
    group = rollout.n_samples_per_prompt
    before = (recomputing.progress.value, reusing.progress.value)
    train_on_samples(recomputing, samples, AlgoConfig(), group_size=group)
    train_on_samples(reusing, samples, AlgoConfig(use_rollout_logprobs=True), group_size=group)
    # the same training forwards; the reusing trainer scored one pass fewer (the policy's old log-probs)
    assert (recomputing.progress.value - before[0]) - (reusing.progress.value - before[1]) == 1
    after = reusing.model.state_dict()
    changed = False
    for name, tensor in recomputing.model.state_dict().items():
        assert torch.equal(tensor, after[name]), name
        changed |= not torch.equal(tensor, recomputing.ref_model.state_dict()[name])
    assert changed  # the step moved the weights, so equality is not the trivial kind


@pytest.mark.parametrize("device", DEVICES)
def test_engine_log_probs_are_only_close(device):
    """The control: log-probs taken while sampling are not the trainer's bit for bit (why the option exists)."""
    rollout, worker, backend, samples = _setup(device, "float32", logprobs="engine")
    assert worker.describe().logprobs == "engine"
    batch = batch_from_samples(samples, group_size=rollout.n_samples_per_prompt)
    train_lp = backend.compute_log_probs(batch, "policy")
    on = batch.response_mask > 0
    diff = (train_lp[on] - batch.rollout_log_probs[on]).abs().max().item()
    assert 0.0 < diff < 1e-3


def test_teacher_forced_keeps_the_samples():
    """Rescoring changes log-probs only: the same seed samples the same tokens with either option."""
    _, _, _, engine_samples = _setup("cpu", "float32", logprobs="engine")
    _, _, _, tf_samples = _setup("cpu", "float32")
    assert [s.tokens for s in engine_samples] == [s.tokens for s in tf_samples]
    for a, b in zip(engine_samples, tf_samples):
        assert a.rollout_log_probs == pytest.approx(b.rollout_log_probs, abs=1e-4)


def test_worker_without_a_scoring_layout_is_refused():
    with pytest.raises(ValueError, match=r"rollout.logprobs='teacher_forced' needs the trainer's scoring layout"):
        RolloutWorker(MODEL, RolloutConfig(logprobs="teacher_forced"), DataConfig(prompts_per_rollout=2))


def test_engine_in_another_dtype_than_the_trainer_is_refused():
    layout = ScoringLayout(micro_batch_size=8, threads=1, dtype="bfloat16", device="cpu")
    with pytest.raises(ValueError, match=r"set rollout.dtype='bfloat16'"):
        RolloutWorker(
            MODEL, RolloutConfig(logprobs="teacher_forced"), DataConfig(prompts_per_rollout=2), scoring=layout
        )


def test_bf16_trainer_keeps_rope_frequencies_as_loaded():
    """A bf16 trainer built from an fp32 model holds the same model as a bf16 engine: parameters cast,
    the rotary inv_freq buffer (not in the state dict, never synced) left in fp32."""
    path = resolve_model_path(MODEL)
    engine_model = load_model(path, dtype=torch.bfloat16)
    backend = TorchBackend(load_model(path, dtype=torch.float32), OptimConfig(dtype="bfloat16"))
    ours = dict(backend.model.named_buffers())
    for name, buf in engine_model.named_buffers():
        assert ours[name].dtype == buf.dtype and torch.equal(ours[name], buf), name
    assert all(p.dtype == torch.bfloat16 for p in backend.model.parameters())


def test_right_padded_is_the_train_batch_layout():
    padded = right_padded([[5, 6, 7], [8]])
    assert padded.tokens.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert padded.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert padded.position_ids.tolist() == [[0, 1, 2], [0, 0, 0]]


# ---- alignment check ---------------------------------------------------------------------------------


def _cfg(root: str = "runs", **rollout):
    from rollflow.flows.config import RunConfig

    return RunConfig(
        run="tf-align",
        data={"prompts_per_rollout": 16},
        store={"root": root},
        rollout={"n_samples_per_prompt": 4, **rollout},
        train={"micro_batch_size": 16},
    )


def test_alignment_reports_bitwise(tmp_path):
    from rollflow.tasks.debug.alignment import run_alignment_local

    cfg = _cfg(str(tmp_path), logprobs="teacher_forced")
    report = run_alignment_local(cfg)
    check = next(c for c in report.checks if c.name == "train_rollout_logprob_diff")
    assert check.status == "pass", check.message
    assert check.figures["verdict"] == "bitwise" and check.figures["max_abs_diff"] == 0.0
    assert check.message.startswith("bitwise")
    assert report.context["rollout_logprobs"] == "teacher_forced"


def test_mismatch_check_verdicts():
    from rollflow.tasks.debug.checks import AlignmentThresholds
    from rollflow.tasks.debug.train_checks import mismatch_check

    def figs(max_diff: float) -> dict:
        return {
            "n_tokens": 10,
            "temperature": 1.0,
            "mismatch": {
                "bitwise": max_diff == 0.0,
                "n_unequal_tokens": 0 if max_diff == 0 else 3,
                "mean_abs_diff": max_diff / 10,
                "max_abs_diff": max_diff,
                "mean_train_log_prob": -0.5,
                "mean_rollout_log_prob": -0.5,
                "worst_samples": [],
            },
        }

    thr = AlignmentThresholds()
    exact = mismatch_check(figs(0.0), thr, expect_bitwise=True)
    assert (exact.status, exact.figures["verdict"]) == ("pass", "bitwise")
    close = mismatch_check(figs(5e-6), thr)
    assert (close.status, close.figures["verdict"]) == ("pass", "tolerance")
    promised = mismatch_check(figs(5e-6), thr, expect_bitwise=True)
    assert promised.status == "fail" and "3 of 10 tokens differ" in promised.message


# ---- config validation: one line naming the field and the fix ------------------------------------------


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            {"rollout": {"engine": "sglang", "logprobs": "teacher_forced"}},
            "rollout.logprobs='teacher_forced' needs rollout.engine='hf'",
        ),
        (
            {"rollout": {"logprobs": "teacher_forced", "dtype": "bfloat16"}},
            "needs rollout.dtype == train.dtype (got 'bfloat16' and 'float32'); set rollout.dtype='float32'",
        ),
        (
            {"rollout": {"logprobs": "teacher_forced"}, "train": {"backend": "megatron"}},
            "rollout.logprobs='teacher_forced' needs train.backend='torch'",
        ),
        (
            {"rollout": {"logprobs": "teacher_forced", "device": "cuda"}},
            "needs rollout.device and train.device of one type",
        ),
    ],
)
def test_config_rejects_what_cannot_hold(override, expected):
    from rollflow.flows.config_loading import ConfigError, load_config

    overrides = [f"{section}.{key}={value}" for section, fields in override.items() for key, value in _flat(fields)]
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    assert expected in str(err.value)
    assert len(str(err.value).splitlines()) == 2  # "invalid config:" + one line


def _flat(fields: dict, prefix: str = ""):
    for key, value in fields.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", str(value).lower() if isinstance(value, bool) else value


def test_config_accepts_teacher_forced_and_builds_the_layout():
    cfg = _cfg(logprobs="teacher_forced")
    assert cfg.scoring_layout() == ScoringLayout(micro_batch_size=16, threads=1, dtype="float32", device="cpu")
    assert _cfg().scoring_layout() is None


# ---- the deterministic-seed trap ---------------------------------------------------------------------


def test_seeds_of_a_group_differ():
    n, prompts = 8, 64
    seeds = [sample_seed(12345, i) for i in range(n * prompts)]
    assert len(set(seeds)) == len(seeds)
    # across rollouts too (the call seed is rollout.seed * 1000003 + rollout_id)
    cfg = RolloutConfig()
    assert not set(sample_seed(cfg.sampling(0).seed, i) for i in range(512)) & set(
        sample_seed(cfg.sampling(1).seed, i) for i in range(512)
    )


class _SeededPerPrompt:
    """An engine with deterministic seeded sampling that (wrongly) seeds every sample of a prompt alike:
    the trap. Outputs depend only on (prompt, seed)."""

    weight_version = 0

    def generate(self, requests, params):
        out = []
        for req in requests:
            g = torch.Generator().manual_seed(params.seed + sum(req.prompt_ids))
            ids = torch.randint(3, 13, (3,), generator=g).tolist()
            out.append([GenerationOutput(list(ids), [-0.5] * 3, "length") for _ in range(req.n)])
        return out


def test_identical_groups_warn_and_count(caplog):
    from rollflow.tasks.model.tokenizer import load_tokenizer
    from rollflow.tasks.rollout.settings import prompts_for

    tok = load_tokenizer(resolve_model_path(MODEL))
    items = prompts_for(DataConfig(prompts_per_rollout=6), 0)
    params = RolloutConfig().sampling(0)
    with caplog.at_level(logging.WARNING, logger="rollflow.tasks.rollout.generate"):
        samples = generate_samples(_SeededPerPrompt(), tok, items, params, 4)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "6 of 6 prompt groups have 4 identical samples" in warnings[0]
    assert "its own seed" in warnings[0]
    # it names the estimators that get nothing from such groups; a ppo (critic) run is not told "GRPO"
    assert "group-relative estimators (grpo, gspo, rloo" in warnings[0] and "GRPO" not in warnings[0]
    for s in samples:
        s.reward = 0.0
    backend = build_backend(MODEL, OptimConfig(), temperature=1.0)
    _, metrics = prepare_batch(backend, samples, AlgoConfig(), group_size=4)
    assert metrics["rollout/identical_groups"] == 1.0


def test_hf_engine_samples_of_a_group_differ(caplog):
    """One seed per call, one RNG stream: the hf engine's groups are not identical, and nothing warns."""
    with caplog.at_level(logging.WARNING, logger="rollflow.tasks.rollout.generate"):
        rollout, _, backend, samples = _setup("cpu", "float32", logprobs="engine", prompts=32, n=8)
    assert not [r for r in caplog.records if "identical samples" in r.getMessage()]
    _, metrics = prepare_batch(backend, samples, AlgoConfig(), group_size=8)
    assert metrics["rollout/identical_groups"] == 0.0


def test_greedy_groups_do_not_warn(caplog):
    from rollflow.tasks.model.tokenizer import load_tokenizer
    from rollflow.tasks.rollout.settings import prompts_for

    tok = load_tokenizer(resolve_model_path(MODEL))
    items = prompts_for(DataConfig(prompts_per_rollout=3), 0)
    with caplog.at_level(logging.WARNING, logger="rollflow.tasks.rollout.generate"):
        generate_samples(_SeededPerPrompt(), tok, items, RolloutConfig().sampling(0, greedy=True), 2)
    assert not caplog.records


def test_identical_groups_by_hand():
    seqs = [[1, 2], [1, 2], [1, 2], [1, 3], [4], [4]]
    assert identical_groups(seqs, 2) == [0, 2]
    assert identical_group_fraction(seqs, 2) == pytest.approx(2 / 3)
    assert identical_groups(seqs, 3) == [0]
    assert identical_groups(seqs, 1) == [] and identical_group_fraction(seqs, 1) == 0.0
    assert identical_group_fraction([], 4) == 0.0


def test_sglang_repeat_mode_seeds_every_sample(monkeypatch):
    from rollflow.tasks.rollout.sglang.engine import SGLangEngine

    engine = SGLangEngine(["http://127.0.0.1:9"], seeded=True, n_mode="repeat")
    sent = []

    def run_job(ids, params, n, rid, seeds):
        sent.append((tuple(ids), seeds[0]))
        return [GenerationOutput([3], [-0.1], "length")]

    monkeypatch.setattr(engine, "_run_job", run_job)
    engine.generate(
        [GenerationRequest(prompt_ids=[5, 6], n=4), GenerationRequest(prompt_ids=[7], n=4)], SamplingParams(seed=7)
    )
    group0 = [seed for ids, seed in sent if ids == (5, 6)]
    assert len(group0) == 4 and len(set(seed for _, seed in sent)) == 8


def test_sglang_native_seeded_groups_get_one_seed_per_sample(monkeypatch):
    """SGLang's native n copies one sampling_seed to all n samples: seeded native n sends n seeds
    (one batch request per prompt, tests/test_sglang_protocol.py checks the body)."""
    from rollflow.flows.config_loading import load_config
    from rollflow.tasks.rollout.sglang.engine import SGLangEngine

    load_config(overrides=["rollout.engine=sglang", "rollout.sglang.seeded=true", "rollout.sglang.n_mode=native"])
    engine = SGLangEngine(["http://127.0.0.1:9"], seeded=True, n_mode="native")
    sent = []

    def run_job(ids, params, n, rid, seeds):
        sent.append(list(seeds))
        return [GenerationOutput([3], [-0.1], "length")] * n

    monkeypatch.setattr(engine, "_run_job", run_job)
    engine.generate(
        [GenerationRequest(prompt_ids=[5, 6], n=4), GenerationRequest(prompt_ids=[7], n=4)], SamplingParams(seed=7)
    )
    assert [len(s) for s in sent] == [4, 4] and len({x for s in sent for x in s}) == 8
