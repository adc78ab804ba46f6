"""The plain (Prefect-free, Ray-free) pieces: hf engine, train step, sync + parity, replay inputs."""

from __future__ import annotations

import asyncio
import sys
import types

import pytest

from rollflow.artifacts.sample import Sample, Status
from rollflow.tasks.model.source import resolve_model_path
from rollflow.tasks.model.tiny import load_model
from rollflow.tasks.rollout.engine import GenerationRequest, SamplingParams
from rollflow.tasks.rollout.rewards import resolve_reward_fn, score_samples
from rollflow.tasks.rollout.settings import DataConfig, RolloutConfig
from rollflow.tasks.rollout.worker import RolloutWorker
from rollflow.tasks.sync.parity import checksums, compare
from rollflow.tasks.train.replay import infer_group_size, subsample_groups
from rollflow.tasks.train.settings import AlgoConfig, OptimConfig
from rollflow.tasks.train.step import train_on_samples
from rollflow.tasks.train.torch_backend import TorchBackend


@pytest.fixture(scope="module")
def engine_worker():
    return RolloutWorker(
        "builtin:addition", RolloutConfig(n_samples_per_prompt=4), DataConfig(prompts_per_rollout=16, eval_prompts=16)
    )


@pytest.fixture
def backend():
    return TorchBackend(
        load_model(resolve_model_path("builtin:addition")), OptimConfig(num_steps_per_rollout=1, micro_batch_size=32)
    )


def scored(worker, rollout_id=0):
    return score_samples(worker.rollout(rollout_id), resolve_reward_fn("addition"))


def test_engine_groups_statuses_and_logprobs(engine_worker, backend):
    samples = scored(engine_worker)
    assert len(samples) == 16 * 4
    assert [s.group_index for s in samples[:8]] == [0, 0, 0, 0, 1, 1, 1, 1]
    for s in samples:
        s.validate()
        assert s.status in (Status.COMPLETED, Status.TRUNCATED)
        if s.status == Status.COMPLETED:
            assert s.tokens[-1] == engine_worker.tokenizer.eos_token_id
        else:
            assert s.response_length == engine_worker.rollout_cfg.max_new_tokens
    # Engine log-probs are the sampling distribution's: equal to the trainer's teacher-forced ones
    # up to fp32 noise from different sequence lengths (docs/architecture.md section 10).
    result = train_on_samples(backend, samples, AlgoConfig(), group_size=4)
    assert result.metrics["train/train_rollout_logprob_abs_diff"] < 1e-4


def test_truncation_and_stop_tokens():
    worker = RolloutWorker("builtin:addition", RolloutConfig(max_new_tokens=2), DataConfig(prompts_per_rollout=4))
    samples = worker.rollout(0, greedy=True)
    assert all(s.status == Status.TRUNCATED and s.response_length == 2 for s in samples)
    # A stop token id ends generation with status completed.
    prompt = worker.tokenizer.encode("012+345=")
    first = worker.generate([GenerationRequest([1] + prompt)], SamplingParams(temperature=0, max_new_tokens=5))
    stop_id = first[0][0].response_ids[0]
    out = worker.generate(
        [GenerationRequest([1] + prompt, n=3)],
        SamplingParams(temperature=0, max_new_tokens=5, stop_token_ids=(stop_id,)),
    )
    assert [o.response_ids for o in out[0]] == [[stop_id]] * 3 and out[0][0].finish_reason == "stop"


def test_step1_exact_then_policy_moves(engine_worker, backend):
    samples = scored(engine_worker)
    m1 = train_on_samples(backend, samples, AlgoConfig(), group_size=4).metrics
    assert m1["rollout/log_probs_equal_ref"] == 1.0 and m1["rollout/kl"] == 0.0
    assert m1["train/ppo_kl"] == 0.0 and m1["train/pg_clipfrac"] == 0.0
    m2 = train_on_samples(backend, scored(engine_worker, 1), AlgoConfig(), group_size=4).metrics
    assert m2["rollout/log_probs_equal_ref"] == 0.0 and m2["rollout/kl"] != 0.0


def test_micro_batching_does_not_change_the_step(engine_worker):
    samples = scored(engine_worker)
    results = []
    for micro in (64, 16):
        be = TorchBackend(
            load_model(resolve_model_path("builtin:addition")),
            OptimConfig(num_steps_per_rollout=1, micro_batch_size=micro),
        )
        results.append(train_on_samples(be, samples, AlgoConfig(), group_size=4).metrics)
    assert results[0]["train/loss"] == pytest.approx(results[1]["train/loss"], abs=1e-6)
    assert results[0]["train/grad_norm"] == pytest.approx(results[1]["train/grad_norm"], rel=1e-4)


def test_sync_parity_and_weight_version(engine_worker, backend):
    samples = scored(engine_worker)
    train_on_samples(backend, samples, AlgoConfig(), group_size=4)
    before = compare(checksums(backend.named_weights()), engine_worker.weight_checksums())
    assert not before.ok and before.mismatched  # the trainer moved, the engine did not yet
    version = engine_worker.update_weights(backend.named_weights(), engine_worker.weight_version() + 1)
    assert version == 1
    assert compare(checksums(backend.named_weights()), engine_worker.weight_checksums()).ok
    with pytest.raises(ValueError, match="does not follow"):
        engine_worker.update_weights(backend.named_weights(), 5)


def test_parity_names_corrupted_and_swapped_tensors(backend):
    trainer = backend.named_weights()
    engine = dict(trainer)
    name = "model.layers.1.mlp.down_proj.weight"
    engine[name] = engine[name].clone()
    engine[name][0, 0] += 1e-3
    report = compare(checksums(trainer), checksums(engine))
    assert not report.ok and report.mismatched == [name] and name in report.summary()
    swapped = dict(trainer)
    a, b = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"
    swapped[a], swapped[b] = trainer[b], trainer[a]
    assert set(compare(checksums(trainer), checksums(swapped)).mismatched) == {a, b}


def test_checkpoint_roundtrip_restores_training_state(engine_worker):
    samples = scored(engine_worker)
    cfg = OptimConfig(num_steps_per_rollout=2, micro_batch_size=32)
    a = TorchBackend(load_model(resolve_model_path("builtin:addition")), cfg)
    train_on_samples(a, samples, AlgoConfig(), group_size=4)
    state = a.checkpoint_bytes()
    b = TorchBackend(load_model(resolve_model_path("builtin:addition")), cfg)
    b.load_checkpoint_bytes(state)
    next_samples = scored(engine_worker, 2)
    ma = train_on_samples(a, next_samples, AlgoConfig(), group_size=4).metrics
    mb = train_on_samples(b, next_samples, AlgoConfig(), group_size=4).metrics
    assert ma == mb


def _group(gi: int, rewards: list[float]) -> list[Sample]:
    return [
        Sample(
            group_index=gi,
            index=gi * 10 + i,
            prompt="p",
            tokens=[1, 5, 6],
            response="x",
            response_length=1,
            loss_mask=[1],
            rollout_log_probs=[-0.5],
            reward=r,
        )
        for i, r in enumerate(rewards)
    ]


def test_subsample_keeps_whole_groups_first_and_last():
    samples = [s for g in range(6) for s in _group(g, [0.0, 1.0])]
    kept = subsample_groups(samples, 0.5, 2)
    assert [s.group_index for s in kept] == [0, 0, 1, 1, 5, 5]
    assert infer_group_size(kept) == 2
    with pytest.raises(ValueError, match="keeps 0 of 6 prompt groups"):
        subsample_groups(samples, 0.1, 2)


def test_infer_group_size_rejects_ragged_groups():
    with pytest.raises(ValueError, match="different sizes"):
        infer_group_size(_group(0, [1.0, 0.0]) + _group(1, [1.0]))


def test_dotted_path_rewards_sync_async_and_dict():
    mod = types.ModuleType("rf_test_rewards")

    def length_reward(sample):
        return float(sample.response_length)

    async def async_reward(sample):
        await asyncio.sleep(0)
        return 2.0

    def dict_reward(sample):
        return {"score": 3.0, "format": 1.0}

    mod.length_reward, mod.async_reward, mod.dict_reward = length_reward, async_reward, dict_reward
    sys.modules["rf_test_rewards"] = mod
    try:
        samples = _group(0, [None, None])
        assert [s.reward for s in score_samples(samples, resolve_reward_fn("rf_test_rewards:length_reward"))] == [
            1.0,
            1.0,
        ]
        assert [s.reward for s in score_samples(samples, resolve_reward_fn("rf_test_rewards.async_reward"))] == [
            2.0,
            2.0,
        ]
        out = score_samples(samples, resolve_reward_fn("rf_test_rewards:dict_reward"), reward_key="score")
        assert out[0].scalar_reward() == 3.0
        with pytest.raises(ValueError, match="reward_key"):
            score_samples(samples, resolve_reward_fn("rf_test_rewards:dict_reward"))
        with pytest.raises(ValueError, match="no callable"):
            resolve_reward_fn("rf_test_rewards:missing")
    finally:
        del sys.modules["rf_test_rewards"]


def test_prefix_parity_catches_swapped_layers(engine_worker, backend):
    """The SGLang-style parity (heads of every tensor by name) on the hf engine's tensors."""
    from rollflow.tasks.sync.parity import compare_prefixes, tensor_prefix

    engine_worker.update_weights(backend.named_weights(), engine_worker.weight_version() + 1)
    trainer_heads = {k: tensor_prefix(v, 16) for k, v in backend.named_weights().items()}
    engine_heads = engine_worker.weight_prefixes(sorted(trainer_heads), 16)
    assert compare_prefixes(trainer_heads, engine_heads).ok
    a, b = "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"
    engine_heads[a], engine_heads[b] = engine_heads[b], engine_heads[a]
    del engine_heads["model.norm.weight"]
    report = compare_prefixes(trainer_heads, engine_heads)
    assert report.mismatched == [a, b] and report.missing_in_engine == ["model.norm.weight"]


def test_sglang_weight_prefixes_flatten_nested_lists():
    from rollflow.tasks.rollout.worker import RolloutWorker, _flatten

    assert _flatten([[1.0, 2.0], [3.0]]) == [1.0, 2.0, 3.0]

    class FakeSGLang:
        urls = ["http://a", "http://b"]

        def __init__(self, stale_url=None):
            self.stale_url = stale_url

        def get_weights_by_name(self, name, truncate_size=100, url=None):
            if name != "w":
                return None
            return [[9.0, 0.25], [0.125, 1.0]] if url == self.stale_url else [[0.5, 0.25], [0.125, 1.0]]

    worker = RolloutWorker.__new__(RolloutWorker)
    worker.engine = FakeSGLang()
    assert worker.weight_prefixes(["w", "missing"], 3) == {"w": [0.5, 0.25, 0.125]}
    # a second server holding other values shows up under name@url (parity then reports it)
    worker.engine = FakeSGLang(stale_url="http://b")
    heads = worker.weight_prefixes(["w"], 3)
    assert heads == {"w": [0.5, 0.25, 0.125], "w@http://b": [9.0, 0.25, 0.125]}
    from rollflow.tasks.sync.parity import compare_prefixes

    report = compare_prefixes({"w": [0.5, 0.25, 0.125]}, heads)
    assert not report.ok and report.mismatched == ["w@http://b"]
