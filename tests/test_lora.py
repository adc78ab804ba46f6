"""LoRA on the torch backend (model.lora): only the adapter trains, the reference is the base model, weights go out
merged (checked against W + (alpha / r) * B @ A computed here), checkpoints hold the adapter and resume bit for bit,
the hf engine takes the merged weights with parity, and rl_train runs and resumes with it."""

from __future__ import annotations

import io

import pytest
import torch

from rollflow.tasks.model.source import resolve_model_path
from rollflow.tasks.model.tiny import load_model
from rollflow.tasks.rollout.rewards import resolve_reward_fn, score_samples
from rollflow.tasks.rollout.settings import DataConfig, RolloutConfig
from rollflow.tasks.rollout.worker import RolloutWorker
from rollflow.tasks.sync.parity import checksums, compare
from rollflow.tasks.train.batch import batch_from_samples
from rollflow.tasks.train.checkpoint_weights import hf_weights_of_checkpoint
from rollflow.tasks.train.lora_backend import LoraTorchBackend
from rollflow.tasks.train.settings import LORA_DEFAULT_TARGETS, AlgoConfig, LoraSettings, OptimConfig
from rollflow.tasks.train.step import train_on_samples
from rollflow.tasks.train.torch_backend import TorchBackend

pytest.importorskip("peft")

LORA = LoraSettings(rank=4, alpha=8.0)
OPTIM = OptimConfig(num_steps_per_rollout=2, micro_batch_size=32, lr=5e-3)
PEFT = "base_model.model."


@pytest.fixture(scope="module")
def engine_worker():
    return RolloutWorker(
        "builtin:addition", RolloutConfig(n_samples_per_prompt=4), DataConfig(prompts_per_rollout=16, eval_prompts=16)
    )


def base_model():
    return load_model(resolve_model_path("builtin:addition"))


def lora_backend(lora: LoraSettings = LORA) -> LoraTorchBackend:
    return LoraTorchBackend(base_model(), OPTIM, lora)


def scored(worker, rollout_id=0):
    return score_samples(worker.rollout(rollout_id), resolve_reward_fn("addition"))


def hf_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def adapter_tensors(backend) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in backend.model.named_parameters() if v.requires_grad}


def test_lora_trains_only_the_adapter_and_weights_go_out_merged(engine_worker):
    base = hf_state(base_model())
    backend = lora_backend()
    adapter0 = adapter_tensors(backend)
    # A and B on every target projection of both layers; nothing else trains, and only they are in the optimizer.
    n_targets = 2 * len(LORA_DEFAULT_TARGETS)
    assert len(adapter0) == 2 * n_targets and all(".lora_A." in k or ".lora_B." in k for k in adapter0)
    assert sum(len(g["params"]) for g in backend.optimizer.param_groups) == 2 * n_targets
    assert all(torch.count_nonzero(v) == 0 for k, v in adapter0.items() if ".lora_B." in k)

    # Step 0: B is zero, so the merged weights are the base weights exactly, names and shapes as without LoRA.
    merged0 = backend.named_weights()
    assert list(merged0) == list(base)
    assert all(torch.equal(merged0[k], base[k]) for k in base)
    m1 = train_on_samples(backend, scored(engine_worker), AlgoConfig(), group_size=4).metrics
    assert m1["rollout/log_probs_equal_ref"] == 1.0 and m1["rollout/kl"] == 0.0
    assert m1["train/step1_ppo_kl"] == 0.0

    # After training: the base is bit for bit untouched, every A and B moved.
    frozen = {k: v for k, v in backend.model.state_dict().items() if ".lora_" not in k}
    assert len(frozen) == len(base)
    for name, tensor in frozen.items():
        assert torch.equal(tensor, base[name.removeprefix(PEFT).replace(".base_layer.", ".")]), name
    adapter1 = adapter_tensors(backend)
    assert all(not torch.equal(adapter1[k], adapter0[k]) for k in adapter0)

    # Merged by hand: W + (alpha / r) * B @ A on the targets, the base elsewhere, the adapter unchanged by the merge.
    merged = backend.named_weights()
    assert list(merged) == list(base)
    assert {k: v.shape for k, v in merged.items()} == {k: v.shape for k, v in base.items()}
    scale = LORA.alpha / LORA.rank
    adapted = 0
    for name, w in base.items():
        module = name.removesuffix(".weight")
        a_name = f"{PEFT}{module}.lora_A.default.weight"
        if a_name in adapter1:
            b = adapter1[f"{PEFT}{module}.lora_B.default.weight"]
            expected = w + scale * (b @ adapter1[a_name])
            assert torch.equal(merged[name], expected), name
            assert not torch.equal(merged[name], w)
            adapted += 1
        else:
            assert torch.equal(merged[name], w), name
    assert adapted == n_targets
    assert all(torch.equal(v, adapter1[k]) for k, v in adapter_tensors(backend).items())
    assert all(torch.equal(backend.weight_tensors()[k], merged[k]) for k in merged)

    # The reference stays the base model: equal to a plain backend's policy log-probs on the base weights.
    batch = batch_from_samples(scored(engine_worker, 1), group_size=4)
    plain = TorchBackend(base_model(), OPTIM, keep_ref=False)
    assert torch.equal(backend.compute_log_probs(batch, "ref"), plain.compute_log_probs(batch))
    assert not torch.equal(backend.compute_log_probs(batch), plain.compute_log_probs(batch))

    # The hf engine takes the merged weights: parity against the trainer's fingerprints.
    engine_worker.update_weights(backend.named_weights(), 1)
    assert compare(checksums(backend.weight_tensors()), checksums(engine_worker.engine.named_weights())).ok


def test_lora_checkpoint_holds_the_adapter_and_resumes_bitwise(engine_worker):
    first = lora_backend()
    train_on_samples(first, scored(engine_worker, 0), AlgoConfig(), group_size=4)
    payload = first.checkpoint_bytes()
    state = torch.load(io.BytesIO(payload), weights_only=True)
    assert set(state) == {"format", "lora", "adapter", "optimizer", "rng"}  # no base weights
    full = TorchBackend(base_model(), OPTIM).checkpoint_bytes()
    assert len(payload) < len(full) / 3

    resumed = lora_backend()
    resumed.load_checkpoint_bytes(payload)
    w1, w2 = first.named_weights(), resumed.named_weights()
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    # The engine's view of a checkpoint without a trainer: the same merged weights.
    from_ckpt = hf_weights_of_checkpoint(payload, resolve_model_path("builtin:addition"))
    assert list(from_ckpt) == list(w1) and all(torch.equal(from_ckpt[k], w1[k]) for k in w1)

    # The next step is the same step on both (optimizer moments and RNG restored too).
    samples = scored(engine_worker, 1)
    m1 = train_on_samples(first, samples, AlgoConfig(), group_size=4).metrics
    m2 = train_on_samples(resumed, samples, AlgoConfig(), group_size=4).metrics
    assert m1 == m2
    a1, a2 = adapter_tensors(first), adapter_tensors(resumed)
    assert all(torch.equal(a1[k], a2[k]) for k in a1)
    assert first.checkpoint_bytes() == resumed.checkpoint_bytes()


def test_lora_and_full_checkpoints_refuse_each_other():
    lora_payload = lora_backend().checkpoint_bytes()
    with pytest.raises(ValueError, match="LoRA adapter .*model.lora"):
        TorchBackend(base_model(), OPTIM).load_checkpoint_bytes(lora_payload)
    with pytest.raises(ValueError, match="full weights .*model.lora"):
        lora_backend().load_checkpoint_bytes(TorchBackend(base_model(), OPTIM).checkpoint_bytes())
    with pytest.raises(ValueError, match="model.lora=.*rank"):
        lora_backend(LoraSettings(rank=2)).load_checkpoint_bytes(lora_payload)


def test_lora_dropout_acts_in_the_gradient_forward_only(engine_worker):
    backend = lora_backend(LoraSettings(rank=4, alpha=8.0, dropout=0.5))
    samples = scored(engine_worker)
    m = train_on_samples(backend, samples, AlgoConfig(), group_size=4).metrics
    assert m["rollout/log_probs_equal_ref"] == 1.0  # scoring forwards run without dropout
    batch = batch_from_samples(samples, group_size=4)
    assert torch.equal(backend.compute_log_probs(batch), backend.compute_log_probs(batch))


# -- config ------------------------------------------------------------------------------------------------------
def test_lora_config_and_refusals(tmp_path, monkeypatch):
    from rollflow.flows import config as config_mod
    from rollflow.flows.config_loading import ConfigError, load_config

    cfg = load_config(None, ["model.lora.rank=16", "model.lora.alpha=32", f"store.root={tmp_path}"])
    assert cfg.model.lora.scaling == 2.0 and cfg.model.lora.target_modules == LORA_DEFAULT_TARGETS
    assert load_config(None, []).model.lora is None
    refusals = {
        "train.backend=megatron": "model.lora needs train.backend=torch",
        "rollout.logprobs=teacher_forced": "rollout.logprobs='engine'",
        "model.lora.rank=0": "model.lora.rank",
        "model.lora.dropout=1": "model.lora.dropout",
        "model.lora.target_modules=[]": "model.lora.target_modules",
        "model.lora.bias=all": "model.lora.bias: unknown field",
    }
    for extra, needle in refusals.items():
        with pytest.raises(ConfigError) as err:
            load_config(None, ["model.lora.rank=4", extra])
        assert needle in str(err.value), (extra, str(err.value))
        assert str(err.value).count("\n") <= 1  # "invalid config:" + one line
    sglang = load_config(None, ["model.lora.rank=4", "rollout.engine=sglang"])
    assert any("merged weights" in n for n in sglang.notices)
    monkeypatch.setattr(config_mod, "peft_available", lambda: False)
    with pytest.raises(ConfigError, match=r"pip install 'rollflow\[lora\]'"):
        load_config(None, ["model.lora.rank=4"])
    load_config(None, ["model.lora.rank=4", "debug.rollout_only=true"])  # the engine merges without peft


def test_lora_target_that_matches_nothing_names_the_field():
    with pytest.raises(ValueError, match="model.lora.target_modules"):
        lora_backend(LoraSettings(target_modules=("no_such_proj",)))


def test_megatron_trainer_refuses_lora_before_loading_anything():
    from rollflow.tasks.train.worker import build_backend

    with pytest.raises(NotImplementedError, match="megatron-core's LoRA is not wired"):
        build_backend("builtin:addition", OptimConfig(backend="megatron"), temperature=1.0, lora=LORA)


# -- rl_train with LoRA (Prefect + Ray) -----------------------------------------------------------------------------
@pytest.mark.slow
def test_rl_train_with_lora_syncs_merged_weights_and_resumes(tmp_path, prefect_api, ray_local):
    from rollflow.flows.reporting import read_metrics
    from rollflow.flows.train import rl_train
    from rollflow.tasks.train.checkpoint import load_checkpoint
    from tests.conftest import small_config

    model = {"lora": {"rank": 4, "alpha": 8.0}}
    train = {"num_steps_per_rollout": 2, "micro_batch_size": 64, "lr": 5e-3}
    cfg = small_config(tmp_path, run="lora-e2e", iterations=2, model=model, train=train)
    rl_train(cfg)
    rows = read_metrics(cfg)
    assert len(rows) == 2
    assert all(row["sync/parity_ok"] == 1.0 for row in rows)
    assert rows[0]["rollout/log_probs_equal_ref"] == 1.0 and rows[0]["train/step1_ppo_kl"] == 0.0
    assert rows[1]["rollout/kl"] > 0  # the policy moved away from the base (the reference)
    payload = load_checkpoint(str(tmp_path), cfg.run, 2)
    assert torch.load(io.BytesIO(payload), weights_only=True)["format"] == "rollflow-lora-1"

    # Replay of rollouts 0 and 1 (no engine) ends on checkpoint 2's adapter and optimizer, bit for bit.
    from rollflow.flows.debug import replay_train
    from rollflow.tasks.train.checkpoint import load_state

    replay_cfg = small_config(
        tmp_path, run="lora-replay", iterations=2, model=model, train=train, debug={"train_only": True}
    )
    out = replay_train(replay_cfg, rollout_ids=[0, 1], source_run=cfg.run)
    replayed = torch.load(io.BytesIO(load_state(out["final_state"])), weights_only=True)
    ran = torch.load(io.BytesIO(payload), weights_only=True)
    assert replayed["adapter"].keys() == ran["adapter"].keys()
    assert all(torch.equal(replayed["adapter"][k], ran["adapter"][k]) for k in ran["adapter"])

    cfg3 = small_config(tmp_path, run="lora-e2e", iterations=3, model=model, train=train)
    summary = rl_train(cfg3)
    assert summary["resumed_from"] == 2
    rows3 = read_metrics(cfg3)
    assert len(rows3) == 3 and rows3[2]["sync/parity_ok"] == 1.0
    assert rows3[:2] == rows  # the first two iterations were not redone


def test_reference_drill_is_refused_under_lora_before_any_worker_is_built(tmp_path, monkeypatch):
    """Under LoRA the reference is the base model with the adapters off: `faults.perturb_ref_std` has nothing of
    its own to perturb, so `rollflow align` refuses it in one line naming the field, before building a worker
    (it used to build both and fail with a TypeError from inside the trainer)."""
    from rollflow.flows.config_loading import load_config
    from rollflow.tasks.debug import alignment
    from rollflow.tasks.debug.faults import AlignmentFaults

    cfg = load_config(None, ["model.lora.rank=4", f"store.root={tmp_path}"])
    monkeypatch.setattr(alignment, "alignment_workers", lambda cfg: pytest.fail("a worker was built"))
    with pytest.raises(ValueError) as err:
        alignment.run_alignment_local(cfg, faults=AlignmentFaults(perturb_ref_std=0.05))
    message = str(err.value)
    assert "faults.perturb_ref_std" in message and "model.lora" in message and "\n" not in message
    # what LoRA leaves alone is not refused: the same fault on a full model, other faults under LoRA
    assert AlignmentFaults(perturb_ref_std=0.05).refusal(lora=False) is None
    assert AlignmentFaults(perturb_policy_std=0.05, gibberish_weights="shuffle").refusal(lora=True) is None
