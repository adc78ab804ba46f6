"""A sharded megatron trainer through `rl_train`: tensor parallel 2 as two trainer actors (gloo on CPU), the
weights gathered over TP for every sync (parity with the engine checked each iteration), Megatron's distributed
checkpoints committed by the run's checkpoint protocol, and a resume that loads them.

Megatron's CUDA-only code paths run through the test-only shims inside the actors (tests/drill_workers.py:
CpuMegatronTrainWorker); on CUDA the product path is the same without them."""

from __future__ import annotations

import json
import os
import uuid

import pytest

try:
    import megatron.core  # noqa: F401

    HAVE_MEGATRON = True
except ImportError:
    HAVE_MEGATRON = False

from tests.conftest import small_config

FAKE = "fake_gpu"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not HAVE_MEGATRON, reason="needs megatron-core (pip install 'rollflow[megatron]')"),
]


def _config(tmp_path, run: str, iterations: int, tp: int = 2, **extra):
    return small_config(
        tmp_path,
        run=run,
        iterations=iterations,
        eval_every=0,
        data={"prompts_per_rollout": 8},
        **extra,
        placement="colocate",
        resources={"num_gpus": tp, "trainer_gpus": tp, "num_engines": 1, "gpus_per_engine": tp, "gpu_resource": FAKE},
        train={
            "backend": "megatron",
            "num_steps_per_rollout": 2,
            "micro_batch_size": 8,
            "megatron": {"tp": tp, "layer_spec": "sdpa", "optimizer": "megatron"},
        },
    )


def test_tensor_parallel_trainer_trains_syncs_checkpoints_and_resumes(tmp_path, prefect_api, ray_local, monkeypatch):
    import rollflow.flows.group as group_module
    from rollflow.flows.group import WorkerGroup
    from rollflow.flows.reporting import read_metrics
    from rollflow.flows.train import rl_train
    from rollflow.tasks.train.checkpoint import checkpoint_dir, list_checkpoints
    from tests.drill_workers import CpuMegatronTrainWorker

    monkeypatch.setattr(group_module, "TrainWorker", CpuMegatronTrainWorker)
    run = f"mtp-{uuid.uuid4().hex[:8]}"
    cfg = _config(tmp_path, run, iterations=2)
    rl_train(cfg)
    rows = read_metrics(cfg)
    assert [r["iteration"] for r in rows] == [1, 2]
    # the engine's weights after each sync equal the TP-gathered trainer weights (checksums of every tensor)
    assert all(r["sync/parity_ok"] == 1.0 for r in rows), rows
    # the same run on one rank (same seeds, same rollout 0): the TP=2 step is the single-rank step
    single = _config(tmp_path, f"{run}-tp1", iterations=1, tp=1)
    rl_train(single)
    one = read_metrics(single)[0]
    assert rows[0]["rollout/raw_reward"] == one["rollout/raw_reward"]
    for key in ("train/loss", "train/grad_norm", "rollout/log_probs", "train/ppo_kl"):
        assert rows[0][key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
    assert list_checkpoints(str(tmp_path), run) == [1, 2]
    _replay_equals_the_run(tmp_path, run, rows)
    folder = checkpoint_dir(str(tmp_path), run, 2)
    with open(os.path.join(folder, "dist", "rollflow_commit.json")) as fh:
        assert json.load(fh)["layout"] == {"tp": 2, "pp": 1, "dp": 1}
    # resume: a new run of the flow continues after checkpoint 2, both ranks loading their shards
    rl_train(_config(tmp_path, run, iterations=3))
    rows = read_metrics(cfg)
    assert [r["iteration"] for r in rows] == [1, 2, 3] and rows[-1]["sync/parity_ok"] == 1.0
    assert list_checkpoints(str(tmp_path), run) == [1, 2, 3]
    assert WorkerGroup.for_run(cfg).any_running() is False


def _replay_equals_the_run(tmp_path, run: str, rows: list[dict]) -> None:
    """Replay of the run's rollouts 0 and 1 with the same TP=2 trainer: the states between steps are Megatron
    distributed checkpoints; each step equals the run's iteration on that rollout (same start, same inputs)."""
    from rollflow.flows.debug import replay_train

    replay_cfg = _config(tmp_path, f"{run}-replay", iterations=1, debug={"train_only": True})
    first = replay_train(replay_cfg, rollout_ids=[0, 1], source_run=run)
    steps = first["steps"]
    assert [s["rollout_id"] for s in steps] == [0, 1] and not any(s["cached"] for s in steps)
    for step, row in zip(steps, rows):
        for key in ("train/loss", "train/grad_norm", "train/ppo_kl", "rollout/log_probs"):
            assert step[key] == pytest.approx(row[key], rel=1e-5, abs=1e-7), (step["rollout_id"], key)
    shards = os.path.join(os.path.dirname(first["final_state"]), "dist")
    with open(os.path.join(shards, "rollflow_commit.json")) as fh:
        assert json.load(fh)["layout"] == {"tp": 2, "pp": 1, "dp": 1}
    again = replay_train(replay_cfg, rollout_ids=[0, 1], source_run=run)
    assert all(s["cached"] for s in again["steps"]) and again["workers_started"] is False


def test_ppo_with_a_tensor_parallel_megatron_trainer_and_a_critic_on_trainer_gpu_0(
    tmp_path, prefect_api, ray_local, monkeypatch
):
    """ppo with the megatron trainer (TP=2) on (fake) GPUs: the critic actor takes its share of trainer GPU 0 and
    hands GAE advantages to both ranks. Its iteration matches the same ppo run on the torch trainer: the critic's
    figures and the advantages exactly (the critic is the same torch model on the same rollout), the policy's
    step to the tolerance the TP=2 and single-rank megatron steps agree to above."""
    import rollflow.flows.group as group_module
    from rollflow.flows.reporting import read_metrics
    from rollflow.flows.train import rl_train
    from tests.drill_workers import CpuMegatronTrainWorker

    monkeypatch.setattr(group_module, "TrainWorker", CpuMegatronTrainWorker)
    run = f"mppo-{uuid.uuid4().hex[:8]}"
    algo = {"advantage_estimator": "ppo", "critic_lr": 1e-3, "lambd": 0.95}
    rl_train(_config(tmp_path, run, iterations=1, algo=algo))
    row = read_metrics(_config(tmp_path, run, iterations=1, algo=algo))[0]
    assert row["sync/parity_ok"] == 1.0 and row["critic/value_loss"] > 0
    monkeypatch.undo()  # the torch trainer without the megatron CPU shims (they are for megatron-core only)
    torch_cfg = small_config(
        tmp_path,
        run=f"{run}-torch",
        iterations=1,
        eval_every=0,
        data={"prompts_per_rollout": 8},
        algo=algo,
        train={"backend": "torch", "num_steps_per_rollout": 2, "micro_batch_size": 8},
    )
    rl_train(torch_cfg)
    ref = read_metrics(torch_cfg)[0]
    assert row["rollout/raw_reward"] == ref["rollout/raw_reward"]
    for key in ("critic/value_loss", "critic/returns", "critic/explained_variance", "rollout/advantages"):
        assert row[key] == ref[key], key
    for key in ("train/loss", "train/grad_norm", "rollout/log_probs", "train/ppo_kl"):
        assert row[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("mode", ["distributed", "tensor"])
def test_tensor_parallel_trainer_syncs_sglang_engines_by_tensor_and_broadcast(
    mode, tmp_path, prefect_api, ray_local, monkeypatch
):
    """The TP=2 trainer into two SGLang-protocol engines (fake servers): `distributed` - both trainer ranks gather
    the weights, rank 0 broadcasts every bucket to the engines' group (gloo); `tensor` - trainer rank r feeds engine
    r, each from its own gathered copy. The startup weight check and the parity after each sync read every tensor
    back from both servers."""
    import rollflow.flows.group as group_module
    from rollflow.flows.reporting import read_metrics
    from rollflow.flows.train import rl_train
    from tests.drill_workers import CpuMegatronTrainWorker
    from tests.test_sglang_contract import fake_launcher

    monkeypatch.setattr(group_module, "TrainWorker", CpuMegatronTrainWorker)
    run = f"mtp-sg-{mode}-{uuid.uuid4().hex[:6]}"
    cfg = small_config(
        tmp_path,
        run=run,
        iterations=2,
        eval_every=0,
        data={"prompts_per_rollout": 4},
        # tensor: colocated (each engine on a trainer rank's GPU); distributed: engines on GPUs of their own
        placement="colocate" if mode == "tensor" else "disaggregated",
        resources={
            "num_gpus": 2 if mode == "tensor" else 4,
            "trainer_gpus": 2,
            "num_engines": 2,
            "gpus_per_engine": 1,
            "gpu_resource": FAKE,
        },
        debug={"check_weight_update_equal": True},
        # The fake server samples from no model: the post-sync probe has nothing to compare with.
        watchdog={"probe_every": 0},
        rollout={
            "engine": "sglang",
            "n_samples_per_prompt": 2,
            "sglang": {
                "launcher": fake_launcher(),
                "startup_timeout_s": 60,
                "weight_sync": mode,
                "weight_sync_backend": "gloo",
                "bucket_mb": 1,
            },
        },
        train={
            "backend": "megatron",
            "num_steps_per_rollout": 1,
            "micro_batch_size": 8,
            "lr": 1e-2,
            "megatron": {"tp": 2, "layer_spec": "sdpa", "optimizer": "megatron"},
        },
    )
    rl_train(cfg)
    rows = read_metrics(cfg)
    assert [r["sync/weight_version"] for r in rows] == [1, 2]
    assert all(r["sync/parity_ok"] == 1.0 for r in rows), rows
