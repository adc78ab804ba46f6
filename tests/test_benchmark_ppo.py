"""The PPO value-loss run's CPU path (issue 36) at the built-in tiny shape, so the GPU command cannot rot.

Runs the command a GPU box runs (`python -m benchmarks.ppo_value_loss`) in a child process, then checks its
JSON against what can be computed without the module's own definitions: the rollouts it committed to the
artifact store (their rewards, recomputed from the token ids; the critic's returns, which with gamma = lambd = 1
are each sample's reward on every response token), and the verdict recomputed from the value-loss series.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from rollflow.artifacts.store import RolloutStore
from rollflow.tasks.model.source import resolve_model_path

REPO = Path(__file__).resolve().parents[1]
ITERATIONS = 6
STAGES = {"generate", "reward", "persist", "critic_estimate", "train", "critic_update", "sync", "parity"}


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ppo")
    out, work = tmp / "ppo.json", tmp / "work"
    command = [sys.executable, "-m", "benchmarks.ppo_value_loss", "--shape", "tiny", "--device", "cpu"]
    command += ["--iterations", str(ITERATIONS), "--out", str(out), "--workdir", str(work), "--threads", "1"]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), work, proc.stderr


def test_the_json_states_the_run(ppo_run):
    result, _, stderr = ppo_run
    assert not result.get("error"), result.get("error")
    assert result["shape"] == "tiny" and result["device"] == "cpu" and result["device_name"] == "cpu"
    assert result["dtype"] == "float32" and result["iterations"] == ITERATIONS
    assert result["train_backend"] == "torch" and result["critic_backend"] == "torch-critic"
    assert "peak_gpu_memory_gib" not in result  # no GPU memory to measure on CPU
    its = result["per_iteration"]
    assert [it["rollout_id"] for it in its] == list(range(ITERATIONS))
    for it in its:
        for key in ("critic/value_loss", "critic/explained_variance", "critic/values", "critic/returns"):
            assert it[key] == it["critic"][key]
        assert it["train/loss"] == it["train"]["train/loss"]
        assert set(it["seconds"]) == STAGES
        assert all(s > 0 for s in it["seconds"].values()), it["seconds"]
        assert 0 < sum(it["seconds"].values()) <= it["iteration_s"]
        assert it["peak_bytes"] == {} and it["parity_ok"] is True
    assert its[0]["critic/values"] == 0.0  # the zero-initialised value head
    assert "value loss falls: pass" in stderr


def test_value_loss_falls(ppo_run):
    result, _, _ = ppo_run
    series = [it["critic/value_loss"] for it in result["per_iteration"]]
    assert result["value_loss"] == series and all(v > 0 for v in series)
    first, last = statistics.fmean(series[:3]), statistics.fmean(series[-3:])
    assert last < first, series
    fl = result["value_loss_first_vs_last"]
    assert fl["k"] == 3
    assert fl["first_mean"] == pytest.approx(first) and fl["last_mean"] == pytest.approx(last)
    assert fl["last_over_first"] == pytest.approx(last / first)
    assert result["checks"] == {"value loss falls": "pass"}
    assert result["explained_variance"] == [it["critic/explained_variance"] for it in result["per_iteration"]]


def test_rewards_and_returns_match_the_committed_rollouts(ppo_run):
    result, work, _ = ppo_run
    vocab = json.loads((resolve_model_path("builtin:addition") / "config.json").read_text())["vocab_size"]
    assert result["reward"]["vocab_size"] == vocab
    store = RolloutStore(str(work / "store"))
    assert store.list_ids("ppo", "train") == list(range(ITERATIONS))
    load = result["workload"]
    for it in result["per_iteration"]:
        samples = store.load("ppo", "train", it["rollout_id"]).samples
        assert len(samples) == it["samples"] == load["prompts"] * load["samples_per_prompt"]
        rewards = [s.reward for s in samples]
        assert it["rewards"] == rewards
        for s in samples:
            response = s.tokens[len(s.tokens) - s.response_length :]
            assert s.reward == pytest.approx(sum(t < vocab / 2 for t in response) / max(len(response), 1))
        assert it["rollout/raw_reward"] == pytest.approx(statistics.fmean(rewards))
        assert it["train"]["rollout/raw_reward"] == pytest.approx(it["rollout/raw_reward"])
        # gamma = lambd = 1: every response token's return is its sample's reward
        tokens = [sum(s.loss_mask) for s in samples]
        returns = sum(r * n for r, n in zip(rewards, tokens)) / sum(tokens)
        assert it["critic/returns"] == pytest.approx(returns, rel=1e-5)
    # the rewards vary (something for a critic to learn)
    assert statistics.pstdev(result["per_iteration"][0]["rewards"]) > 0


def test_summary_figures_recompute(ppo_run):
    result, _, _ = ppo_run
    its = result["per_iteration"]
    assert result["raw_reward"] == [it["rollout/raw_reward"] for it in its]
    for stage in STAGES:
        assert result["stage_seconds_median"][stage] == pytest.approx(
            statistics.median(it["seconds"][stage] for it in its)
        )
