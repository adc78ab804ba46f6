"""Routing replay on a data-parallel torch trainer: two gloo ranks (subprocesses) train on R3 rollouts of
the tiny MoE like one rank, each training forward replaying only its own rows' routes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from rollflow.artifacts.store import ArtifactRef
from rollflow.tasks.net import free_port
from rollflow.tasks.train.data_parallel import DataParallel
from rollflow.tasks.train.settings import AlgoConfig, OptimConfig
from tests.test_train_dp import RANK_TIMEOUT_S, REPO, max_abs_diff

MODEL = "builtin:addition-moe"
OPTIM = dict(num_steps_per_rollout=2, micro_batch_size=12)  # 64 rows: 2 x 32, 16 per rank, micro 12 + 4
REWARD = "tests.reward_fixtures:last_digit"  # the random-init MoE never adds right


@pytest.fixture(scope="module")
def r3_refs(tmp_path_factory):
    """Two scored rollouts of the tiny MoE with routes (16 prompts x 4), committed to a file:// store."""
    from rollflow.artifacts import EngineInfo, RolloutStore
    from rollflow.tasks.rollout.rewards import resolve_reward_fn, score_samples
    from rollflow.tasks.rollout.settings import DataConfig, RolloutConfig
    from rollflow.tasks.rollout.worker import RolloutWorker

    root = f"file://{tmp_path_factory.mktemp('r3-store')}"
    engine = RolloutWorker(
        MODEL, RolloutConfig(n_samples_per_prompt=4), DataConfig(prompts_per_rollout=16), record_routes=True
    )
    store, refs = RolloutStore(root), []
    for rid in (0, 1):
        samples = score_samples(engine.rollout(rid), resolve_reward_fn(REWARD))
        assert all(s.routed_experts is not None for s in samples)
        info = EngineInfo(backend="hf", model=MODEL, weight_version=0)
        ref = store.write("src", "train", rid, samples, n_samples_per_prompt=4, engine=info, config_hash="r3")
        refs.append(ref.to_dict())
    return root, refs


def r3_rank_main(spec_json: str) -> None:
    from rollflow.tasks.train.data_parallel import destroy_data_parallel
    from rollflow.tasks.train.worker import TrainWorker

    spec = json.loads(spec_json)
    dp = DataParallel(rank=spec["rank"], world_size=spec["world"], master_addr="127.0.0.1", master_port=spec["port"])
    algo = AlgoConfig(routing_replay=True)
    worker = TrainWorker(MODEL, OptimConfig(**OPTIM), algo, store_root=spec["root"], run="r3-dp", dp=dp)
    metrics = [worker.train_on_artifact(ArtifactRef.from_dict(ref)) for ref in spec["refs"]]
    torch.save({"metrics": metrics, "weights": worker.named_weights()}, spec["out"])
    destroy_data_parallel()


def _run_two_ranks(spec: dict, tmp_path) -> list[dict]:
    port, procs = free_port(), []
    for rank in range(2):
        args = json.dumps({**spec, "rank": rank, "world": 2, "port": port, "out": str(tmp_path / f"rank{rank}.pt")})
        code = "import sys; from tests.test_moe_dp import r3_rank_main; r3_rank_main(sys.argv[1])"
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code, args],
                cwd=REPO,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        logs = [p.communicate(timeout=RANK_TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # only the ranks this test started, by their handles
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{log[-4000:]}"
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_two_ranks_with_routing_replay_train_like_one(r3_refs, tmp_path):
    from rollflow.tasks.train.worker import TrainWorker

    root, refs = r3_refs
    ranks = _run_two_ranks({"root": root, "refs": refs}, tmp_path)
    solo = TrainWorker(
        MODEL,
        OptimConfig(**OPTIM),
        AlgoConfig(routing_replay=True),
        store_root=root,
        run="r3-solo",
        dp=DataParallel(rank=0, world_size=1, master_addr="127.0.0.1", master_port=1),
    )
    start = solo.named_weights()
    solo_metrics = [solo.train_on_artifact(ArtifactRef.from_dict(ref)) for ref in refs]
    solo_weights = solo.named_weights()
    assert max_abs_diff(ranks[0]["weights"], ranks[1]["weights"]) == 0.0
    diff, update = max_abs_diff(ranks[0]["weights"], solo_weights), max_abs_diff(start, solo_weights)
    print(f"R3 data parallel: max |w_dp - w_single| = {diff:.3g} (largest update {update:.3g})")
    assert diff < 1e-5 and update > 100 * diff
    for dp_m, solo_m in zip(ranks[0]["metrics"], solo_metrics):
        for key in ("train/loss", "train/grad_norm", "train/train_rollout_logprob_abs_diff"):
            assert dp_m[key] == pytest.approx(solo_m[key], rel=1e-4, abs=1e-6), key
