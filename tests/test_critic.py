"""ppo: GAE and the clipped value loss with hand-worked values, the critic worker beside the trainer (no Ray),
config validation, and a short ppo run through rl_train (Prefect + Ray; slow)."""

from __future__ import annotations

import pytest
import torch

from rollflow.tasks.train.advantages import gae, gae_advantages, last_token_rewards
from rollflow.tasks.train.critic import explained_variance, value_loss

R = torch.tensor([[0.0, 0.0, 1.0]])
V = torch.tensor([[0.5, 0.2, 0.4]])


# -- GAE ------------------------------------------------------------------------------------------------------
def test_gae_hand_worked_gamma_lambda_half():
    # t=2: delta = 1 - 0.4 = 0.6                     A = 0.6
    # t=1: delta = 0 + 0.5*0.4 - 0.2 = 0             A = 0 + 0.25*0.6 = 0.15
    # t=0: delta = 0 + 0.5*0.2 - 0.5 = -0.4          A = -0.4 + 0.25*0.15 = -0.3625
    adv, ret = gae(R, V, torch.ones_like(R), gamma=0.5, lambd=0.5)
    torch.testing.assert_close(adv, torch.tensor([[-0.3625, 0.15, 0.6]]), rtol=0, atol=1e-7)
    torch.testing.assert_close(ret, torch.tensor([[0.1375, 0.35, 1.0]]), rtol=0, atol=1e-7)


def test_gae_gamma_lambda_one_is_returns_minus_values():
    rewards = torch.tensor([[0.3, -0.1, 0.0, 1.0], [0.0, 2.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, 0.2, 0.4, -0.3], [1.0, 0.0, 0.25, 0.0]])
    mask = torch.ones_like(rewards)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lambd=1.0)
    to_go = rewards.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(ret, to_go, rtol=0, atol=1e-6)
    torch.testing.assert_close(adv, to_go - values, rtol=0, atol=1e-6)


def test_gae_lambda_zero_is_one_step_td():
    adv, _ = gae(R, V, torch.ones_like(R), gamma=0.9, lambd=0.0)
    expected = torch.tensor([[0.9 * 0.2 - 0.5, 0.9 * 0.4 - 0.2, 1.0 - 0.4]])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-7)


def test_gae_steps_over_masked_tokens():
    # The masked middle token (tool output) is skipped: no TD error, no discount step, its value (9) unused.
    # t=2: A = 0.6; t=0: delta = 0 + 0.5*0.4 - 0.5 = -0.3, A = -0.3 + 0.25*0.6 = -0.15
    values = torch.tensor([[0.5, 9.0, 0.4]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    adv, ret = gae(R, values, mask, gamma=0.5, lambd=0.5)
    torch.testing.assert_close(adv, torch.tensor([[-0.15, 0.0, 0.6]]), rtol=0, atol=1e-7)
    torch.testing.assert_close(ret, torch.tensor([[0.35, 0.0, 1.0]]), rtol=0, atol=1e-7)
    # the same as GAE over the masked-in tokens alone
    compact_adv, _ = gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.4]]), torch.ones(1, 2), gamma=0.5, lambd=0.5)
    torch.testing.assert_close(adv[mask > 0], compact_adv.flatten())


def test_gae_all_masked_row_and_trailing_padding():
    rewards = torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    values = torch.tensor([[3.0, -2.0, 1.0], [0.25, 0.5, 7.0]])
    mask = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lambd=1.0)
    assert torch.equal(adv[0], torch.zeros(3)) and torch.equal(ret[0], torch.zeros(3))
    # padding after the last token does not bootstrap from its value (7)
    torch.testing.assert_close(adv[1], torch.tensor([0.75, 0.5, 0.0]))
    torch.testing.assert_close(ret[1], torch.tensor([1.0, 1.0, 0.0]))


def test_gae_bf16_values_are_upcast():
    adv, ret = gae(R, V.bfloat16(), torch.ones_like(R), gamma=1.0, lambd=1.0)
    assert adv.dtype == torch.float32 and ret.dtype == torch.float32
    torch.testing.assert_close(adv, 1.0 - V.bfloat16().float())


def test_gae_rejects_bad_inputs():
    with pytest.raises(ValueError, match="shapes"):
        gae(R, V[:, :2], torch.ones_like(R), gamma=1.0, lambd=1.0)
    with pytest.raises(ValueError, match="lambd"):
        gae(R, V, torch.ones_like(R), gamma=1.0, lambd=1.5)


def test_last_token_rewards():
    out = last_token_rewards(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1]]))
    assert torch.equal(out, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 3.0]], dtype=out.dtype))


def test_gae_advantages_whitened_over_masked_tokens_returns_raw():
    values = torch.tensor([[0.5, 9.0, 0.4], [0.0, 0.0, 0.0], [0.1, 0.2, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    rewards = torch.tensor([1.0, 5.0, 0.0])
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lambd=1.0)
    raw, raw_ret = gae(last_token_rewards(rewards, mask), values, mask, gamma=1.0, lambd=1.0)
    assert torch.equal(ret, raw_ret)
    on = mask > 0
    # (A - mean) / sqrt(var_unbiased + 1e-8) over the 4 masked-in tokens; 0 elsewhere
    expected = (raw[on] - raw[on].mean()) / torch.sqrt(raw[on].var(unbiased=True) + 1e-8)
    torch.testing.assert_close(adv[on], expected)
    assert torch.equal(adv[~on], torch.zeros(int((~on).sum())))


# -- value loss -------------------------------------------------------------------------------------------------
def _value_case(dtype: torch.dtype):
    values = torch.tensor([1.0, 0.0, 0.5, -1.0], dtype=dtype, requires_grad=True)
    old = torch.tensor([0.5, 0.0, 0.5, 0.0], dtype=dtype)
    returns = torch.tensor([2.0, 1.0, 0.0, 1.0], dtype=dtype)
    return values, old, returns


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_loss_hand_worked(dtype):
    values, old, returns = _value_case(dtype)
    loss, clipped = value_loss(values, old, returns, value_clip=0.2)
    # 0: V_clip = 0.7: max((1-2)^2, (0.7-2)^2) = 1.69 -> 0.845, the clipped branch wins
    # 1: V = V_old: both 1 -> 0.5, not clipped (equal is not greater)
    # 2: V = V_old: both 0.25 -> 0.125
    # 3: V_clip = -0.2: max((-1-1)^2 = 4, (-0.2-1)^2 = 1.44) -> 2.0, the unclipped branch wins
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, torch.tensor([0.845, 0.5, 0.125, 2.0]), rtol=0, atol=1e-6)
    assert clipped.tolist() == [True, False, False, False]
    loss.sum().backward()
    # clipped branch: no gradient toward the return; otherwise d/dV 0.5 (V - R)^2 = V - R
    torch.testing.assert_close(values.grad.float(), torch.tensor([0.0, -1.0, 0.5, -2.0]), rtol=0, atol=1e-6)


def test_value_loss_bf16_equals_fp32_on_representable_inputs():
    loss32, _ = value_loss(*[t.detach() for t in _value_case(torch.float32)], value_clip=0.2)
    loss16, _ = value_loss(*[t.detach() for t in _value_case(torch.bfloat16)], value_clip=0.2)
    assert torch.equal(loss32, loss16)


def test_value_loss_rejects_bad_inputs():
    values, old, returns = _value_case(torch.float32)
    with pytest.raises(ValueError, match="shape"):
        value_loss(values, old[:2], returns, value_clip=0.2)
    with pytest.raises(ValueError, match="value_clip"):
        value_loss(values, old, returns, value_clip=0.0)


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert explained_variance(returns.clone(), returns, mask) == 1.0
    assert explained_variance(torch.full_like(returns, 2.0), returns, mask) == 0.0
    assert explained_variance(returns, torch.ones_like(returns), mask) == 0.0  # constant returns


# -- config ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["algo.advantage_estimator=ppo", "algo.kl_coef=0.1"], "algo.kl_coef=0.1"),
        (
            ["algo.advantage_estimator=ppo", "debug.train_only=true", "debug.load_debug_rollout_data_subsample=0.5"],
            "cannot replay a subsample",
        ),
        (["algo.advantage_estimator=ppo", "resources.critic_gpus=1"], "resources.critic_gpus=1 without GPUs"),
        (["algo.lambd=0.9"], "algo.lambd=0.9 only applies"),
        (["resources.critic_gpus=1"], "resources.critic_gpus=1 only applies to algo.advantage_estimator='ppo'"),
    ],
)
def test_ppo_config_rejections_name_the_field(overrides, needle):
    from rollflow.flows.config_loading import ConfigError, load_config

    with pytest.raises(ConfigError, match="ppo|lambd") as err:
        load_config(None, overrides)
    assert needle in str(err.value)


def test_ppo_config_accepts_megatron_gpus_and_replay():
    """What this build refused before: ppo with the megatron trainer, on GPUs, and replayed."""
    from rollflow.flows.config_loading import load_config

    load_config(None, ["algo.advantage_estimator=ppo", "train.backend=megatron"])
    load_config(None, ["algo.advantage_estimator=ppo", "debug.train_only=true"])
    gpus = load_config(
        None,
        [
            "algo.advantage_estimator=ppo",
            "resources.num_gpus=3",
            "resources.trainer_gpus=1",
            "resources.gpus_per_engine=1",
            "resources.critic_gpus=1",
        ],
    )
    assert gpus.resources.critic_gpus == 1


def test_ppo_config_accepts_gamma_lambd_and_kl_loss():
    from rollflow.flows.config_loading import load_config

    cfg = load_config(
        None,
        [
            "algo.advantage_estimator=ppo",
            "algo.gamma=0.99",
            "algo.lambd=0.95",
            "algo.kl_loss_coef=0.01",
            "algo.value_clip=0.5",
            "algo.critic_lr=1e-4",
        ],
    )
    assert (cfg.algo.gamma, cfg.algo.lambd, cfg.algo.value_clip, cfg.algo.critic_lr) == (0.99, 0.95, 0.5, 1e-4)


# -- the critic worker beside the trainer, in process (no Ray) --------------------------------------------------
@pytest.fixture(scope="module")
def ppo_artifact(tmp_path_factory):
    from rollflow.artifacts.manifest import EngineInfo
    from rollflow.artifacts.store import RolloutStore
    from rollflow.tasks.rollout.rewards import resolve_reward_fn, score_samples
    from rollflow.tasks.rollout.settings import DataConfig, RolloutConfig
    from rollflow.tasks.rollout.worker import RolloutWorker

    root = str(tmp_path_factory.mktemp("ppo-store"))
    worker = RolloutWorker(
        "builtin:addition", RolloutConfig(n_samples_per_prompt=4), DataConfig(prompts_per_rollout=16, eval_prompts=16)
    )
    samples = score_samples(worker.rollout(0), resolve_reward_fn("addition"))
    ref = RolloutStore(root).write(
        "ppo",
        "train",
        0,
        samples,
        n_samples_per_prompt=4,
        engine=EngineInfo(backend="hf", model="builtin:addition", weight_version=0),
        config_hash="test",
    )
    return root, ref


def _ppo_settings(**algo):
    from rollflow.tasks.train.settings import AlgoConfig, OptimConfig

    return (
        OptimConfig(num_steps_per_rollout=2, micro_batch_size=32),
        AlgoConfig(advantage_estimator="ppo", critic_lr=1e-3, **algo),
    )


def test_critic_estimate_update_train_and_checkpoint(ppo_artifact):
    from rollflow.tasks.train.checkpoint import CheckpointError
    from rollflow.tasks.train.critic_worker import CriticWorker
    from rollflow.tasks.train.worker import TrainWorker

    root, ref = ppo_artifact
    optim, algo = _ppo_settings(gamma=1.0, lambd=1.0)
    critic = CriticWorker("builtin:addition", optim, algo, store_root=root, run="ppo")
    estimate = critic.estimate(ref)
    mask = critic._batch.response_mask
    assert estimate.values.shape == estimate.advantages.shape == estimate.returns.shape == mask.shape
    # the zero-initialised head: every old value is 0, so with gamma = lambd = 1 the returns are the reward on
    # every token
    assert torch.equal(estimate.values, torch.zeros_like(mask))
    on = mask > 0
    rewards = critic._batch.rewards.float()[:, None].expand_as(mask)
    torch.testing.assert_close(estimate.returns[on], rewards[on])
    assert torch.equal(estimate.advantages[~on], torch.zeros(int((~on).sum())))
    assert abs(float(estimate.advantages[on].mean())) < 1e-5  # whitened

    metrics = critic.update()
    assert set(metrics) == {
        "critic/value_loss",
        "critic/vf_clipfrac",
        "critic/grad_norm",
        "critic/values",
        "critic/returns",
        "critic/explained_variance",
    }
    assert metrics["critic/value_loss"] > 0 and metrics["critic/values"] == 0.0
    with pytest.raises(RuntimeError, match="before estimate"):
        critic.update()
    # the values moved toward the returns, and a second pass on the same rollout fits them better
    again = critic.estimate(ref)
    assert not torch.equal(again.values, estimate.values)
    assert critic.update()["critic/value_loss"] < metrics["critic/value_loss"]

    trainer = TrainWorker("builtin:addition", optim, algo, store_root=root, run="ppo")
    with pytest.raises(ValueError, match="critic actor"):
        trainer.train_on_artifact(ref)
    out = trainer.train_on_artifact(ref, critic=again)
    assert out["train/ppo_kl"] == out["train/ppo_kl"] and out["train/grad_norm"] > 0
    assert abs(out["rollout/advantages"]) < 1e-5

    # checkpoint: saved beside the policy's, resumed bit for bit; a missing one is named
    uri = critic.save_checkpoint(3)
    assert uri.endswith("/ppo/checkpoints/000003/critic.pt")
    resumed = CriticWorker("builtin:addition", optim, algo, store_root=root, run="ppo", resume_iteration=3)
    assert torch.equal(resumed.estimate(ref).values, critic.estimate(ref).values)
    with pytest.raises(CheckpointError, match="critic state"):
        CriticWorker("builtin:addition", optim, algo, store_root=root, run="ppo", resume_iteration=4)


def test_trainer_refuses_a_critic_estimate_of_another_shape(ppo_artifact):
    from rollflow.tasks.train.critic import CriticEstimate
    from rollflow.tasks.train.worker import TrainWorker

    root, ref = ppo_artifact
    optim, algo = _ppo_settings()
    wrong = CriticEstimate(values=torch.zeros(3, 3), advantages=torch.zeros(3, 3), returns=torch.zeros(3, 3))
    with pytest.raises(ValueError, match="another rollout"):
        TrainWorker("builtin:addition", optim, algo, store_root=root, run="ppo").train_on_artifact(ref, critic=wrong)


# -- rl_train with a critic actor (Prefect + Ray) ---------------------------------------------------------------
@pytest.mark.slow
def test_ppo_rl_train_runs_a_critic_actor_and_resumes_it(tmp_path, prefect_api, ray_local):
    from rollflow.flows.reporting import read_metrics
    from rollflow.flows.train import rl_train
    from tests.conftest import small_config

    algo = {"advantage_estimator": "ppo", "critic_lr": 1e-3, "lambd": 0.95}
    cfg = small_config(tmp_path, run="ppo-e2e", iterations=2, algo=algo)
    rl_train(cfg)
    rows = read_metrics(cfg)
    assert len(rows) == 2
    for row in rows:
        assert row["critic/value_loss"] > 0 and 0 <= row["critic/vf_clipfrac"] <= 1
        assert "critic/returns" in row and "critic/explained_variance" in row
        assert row["sync/parity_ok"] == 1.0
    assert rows[0]["critic/values"] == 0.0  # the zero-initialised head
    assert rows[1]["critic/values"] != 0.0  # the critic trained on rollout 0
    for it in (1, 2):
        assert (tmp_path / "ppo-e2e" / "checkpoints" / f"{it:06d}" / "critic.pt").stat().st_size > 1000
    _replay_equals_the_ppo_run(tmp_path, cfg, rows, algo)
    # resume: a third iteration starts the critic from checkpoint 2's state
    cfg3 = small_config(tmp_path, run="ppo-e2e", iterations=3, algo=algo)
    summary = rl_train(cfg3)
    assert summary["resumed_from"] == 2
    assert len(read_metrics(cfg3)) == 3


def _weights(data: bytes) -> dict[str, torch.Tensor]:
    import io

    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)["model"]


def _replay_equals_the_ppo_run(tmp_path, cfg, rows: list[dict], algo: dict) -> None:
    """Replay of the ppo run's rollouts 0 and 1 (no engine): the critic starts fresh and follows the trainer from
    step to step, so both end exactly where the run's checkpoint 2 is (policy and critic, bit for bit)."""
    from rollflow.flows.debug import replay_train
    from rollflow.tasks.train.checkpoint import load_checkpoint, load_state
    from tests.conftest import small_config

    replay_cfg = small_config(tmp_path, run="ppo-replay", iterations=2, algo=algo, debug={"train_only": True})
    out = replay_train(replay_cfg, rollout_ids=[0, 1], source_run=cfg.run)
    steps = out["steps"]
    assert [s["rollout_id"] for s in steps] == [0, 1] and not any(s["cached"] for s in steps)
    for step, row in zip(steps, rows):
        for key in ("train/loss", "train/grad_norm", "critic/value_loss", "critic/values", "rollout/advantages"):
            assert step[key] == row[key], (step["rollout_id"], key)
    run_policy = _weights(load_checkpoint(str(tmp_path), cfg.run, 2))
    replay_policy = _weights(load_state(out["final_state"]))
    assert run_policy.keys() == replay_policy.keys()
    assert all(torch.equal(run_policy[k], replay_policy[k]) for k in run_policy)
    run_critic = _weights((tmp_path / cfg.run / "checkpoints" / "000002" / "critic.pt").read_bytes())
    replay_critic = _weights(load_state(out["final_state"].rsplit("/", 1)[0] + "/critic.pt"))
    assert all(torch.equal(run_critic[k], replay_critic[k]) for k in run_critic)
    # the same replay again: both steps cached (trainer and critic states kept), no worker started
    again = replay_train(replay_cfg, rollout_ids=[0, 1], source_run=cfg.run)
    assert all(s["cached"] for s in again["steps"]) and again["workers_started"] is False
