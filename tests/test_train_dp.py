"""Data-parallel `torch` backend: N real processes (gloo on CPU) train like one rank.

The ranks run as subprocesses (`python -c "from tests.test_train_dp import ...`), not Ray: the point
is torch.distributed itself. Rollouts are generated once here and handed over through the artifact
store, the way the flows hand them to TrainWorker actors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from rollflow.artifacts.sample import Sample
from rollflow.artifacts.store import ArtifactRef
from rollflow.tasks.net import free_port
from rollflow.tasks.train.data_parallel import DataParallel, shard_rows
from rollflow.tasks.train.objective import minibatch_slices
from rollflow.tasks.train.settings import AlgoConfig, LoraSettings, OptimConfig

REPO = Path(__file__).resolve().parents[1]
MODEL = "builtin:addition"
RANK_TIMEOUT_S = 240


def run_ranks(entry: str, world: int, spec: dict, tmp_path: Path) -> list[dict]:
    """Start `world` processes running `entry(spec_json)`; each writes `rank{r}.pt`; returns them."""
    port = free_port()
    procs = []
    for rank in range(world):
        args = json.dumps({**spec, "rank": rank, "world": world, "port": port, "out": str(tmp_path / f"rank{rank}.pt")})
        code = f"import sys; from tests.test_train_dp import {entry}; {entry}(sys.argv[1])"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code, args],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=RANK_TIMEOUT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{log[-4000:]}"
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


# -- (b) sharding ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_rows,steps,world", [(64, 2, 2), (64, 3, 2), (10, 4, 3), (5, 3, 2), (7, 8, 4), (1, 1, 2)])
def test_shards_are_disjoint_and_cover_every_row(n_rows, steps, world):
    slices = minibatch_slices(n_rows, steps)
    assert len(slices) == min(steps, n_rows)  # every rank runs this many optimizer steps
    per_rank: list[list[int]] = [[] for _ in range(world)]
    for mini in slices:
        rows = list(range(n_rows))[mini]
        sizes = []
        for rank in range(world):
            local = rows[shard_rows(len(rows), rank, world)]
            per_rank[rank] += local
            sizes.append(len(local))
        assert max(sizes) - min(sizes) <= 1  # uneven by at most one row per mini-batch
    everything = [row for rows in per_rank for row in rows]
    assert sorted(everything) == list(range(n_rows)) and len(set(everything)) == n_rows


def test_data_parallel_validation_names_the_field():
    with pytest.raises(ValueError, match=r"DataParallel\.rank=2 must be in \[0, world_size=2\)"):
        DataParallel(rank=2, world_size=2, master_addr="127.0.0.1", master_port=29500)
    with pytest.raises(ValueError, match="DataParallel.world_size=0"):
        DataParallel(rank=0, world_size=0, master_addr="127.0.0.1", master_port=29500)
    with pytest.raises(ValueError, match="DataParallel.backend"):
        DataParallel(rank=0, world_size=2, master_addr="127.0.0.1", master_port=29500, backend="mpi")
    assert DataParallel(0, 2, "::1", 29500).init_method == "tcp://[::1]:29500"


# -- (c) megatron is refused ---------------------------------------------------------------------------


def test_megatron_with_several_ranks_is_refused(tmp_path):
    from rollflow.tasks.train.worker import TrainWorker, build_backend

    optim = OptimConfig(backend="megatron")
    dp = DataParallel(rank=0, world_size=2, master_addr="127.0.0.1", master_port=free_port())
    # On CPU (megatron-core's DDP and optimizer allocate CUDA tensors), and with optimizer=torch anywhere.
    message = r"multi-rank Megatron through the train worker runs on CUDA with Megatron's optimizer"
    with pytest.raises(NotImplementedError, match=message):
        build_backend(MODEL, optim, temperature=1.0, dp=dp)
    with pytest.raises(NotImplementedError, match="trainer_gpus=1"):
        TrainWorker(MODEL, optim, AlgoConfig(), store_root=f"file://{tmp_path}", run="r", dp=dp)
    with pytest.raises(NotImplementedError, match=r"train\.megatron\.optimizer=auto\|megatron"):
        build_backend(
            MODEL,
            OptimConfig(backend="megatron", device="cuda", megatron={"tp": 2, "optimizer": "torch"}),
            temperature=1.0,
            dp=dp,
        )
    assert not torch.distributed.is_initialized()  # refused before joining any group


# -- (a) 2 ranks == 1 rank on a real rollout -------------------------------------------------------------


OPTIM = dict(num_steps_per_rollout=2, micro_batch_size=12)  # 64 rows: 2 x 32, 16 per rank, micro 12 + 4


@pytest.fixture(scope="module")
def rollout_refs(tmp_path_factory):
    """Two scored rollouts of the built-in model (16 prompts x 4), committed once to a file:// store."""
    from rollflow.artifacts import EngineInfo, RolloutStore
    from rollflow.tasks.rollout.rewards import resolve_reward_fn, score_samples
    from rollflow.tasks.rollout.settings import DataConfig, RolloutConfig
    from rollflow.tasks.rollout.worker import RolloutWorker

    root = f"file://{tmp_path_factory.mktemp('dp-store')}"
    engine = RolloutWorker(MODEL, RolloutConfig(n_samples_per_prompt=4), DataConfig(prompts_per_rollout=16))
    store = RolloutStore(root)
    refs = []
    for rid in (0, 1):
        samples = score_samples(engine.rollout(rid), resolve_reward_fn("addition"))
        refs.append(
            store.write(
                "src",
                "train",
                rid,
                samples,
                n_samples_per_prompt=4,
                engine=EngineInfo(backend="hf", model=MODEL, weight_version=0),
                config_hash="dp",
            ).to_dict()
        )
    return root, refs


def worker_rank_main(spec_json: str) -> None:
    """One rank: a TrainWorker trains on the rollouts, rank 0 writes dumps and a checkpoint."""
    from rollflow.tasks.train.data_parallel import destroy_data_parallel
    from rollflow.tasks.train.worker import TrainWorker

    spec = json.loads(spec_json)
    dp = DataParallel(rank=spec["rank"], world_size=spec["world"], master_addr="127.0.0.1", master_port=spec["port"])
    lora = LoraSettings(**spec["lora"]) if spec.get("lora") else None
    run = spec.get("run", "dp")
    worker = TrainWorker(MODEL, OptimConfig(**OPTIM), AlgoConfig(), store_root=spec["root"], run=run, dp=dp, lora=lora)
    metrics = []
    for ref in map(ArtifactRef.from_dict, spec["refs"]):  # refs cross the JSON spec as dicts
        worker.load_artifact(ref)
        metrics.append(worker.train_on_artifact(ref, dump_uri=f"{spec['dump']}/rank{spec['rank']}_{ref.rollout_id}"))
    folder = worker.save_checkpoint(1)
    torch.save(
        {"metrics": metrics, "weights": worker.named_weights(), "describe": worker.describe(), "folder": folder},
        spec["out"],
    )
    destroy_data_parallel()


def test_two_ranks_train_like_one(rollout_refs, tmp_path):
    from rollflow.tasks.train.checkpoint import load_checkpoint
    from rollflow.tasks.train.worker import TrainWorker

    root, refs = rollout_refs
    ranks = run_ranks("worker_rank_main", 2, {"root": root, "refs": refs, "dump": str(tmp_path / "dumps")}, tmp_path)

    # The single-rank reference, in this process; world_size 1 builds no process group.
    solo = TrainWorker(
        MODEL,
        OptimConfig(**OPTIM),
        AlgoConfig(),
        store_root=root,
        run="solo",
        dp=DataParallel(rank=0, world_size=1, master_addr="127.0.0.1", master_port=1),
    )
    assert not torch.distributed.is_initialized()
    start_weights = solo.named_weights()
    solo_metrics = [solo.train_on_artifact(ArtifactRef.from_dict(ref)) for ref in refs]
    solo_weights = solo.named_weights()

    assert [r["describe"].rank for r in ranks] == [0, 1] and ranks[0]["describe"].world_size == 2
    # All ranks step identically: bitwise equal weights.
    assert max_abs_diff(ranks[0]["weights"], ranks[1]["weights"]) == 0.0
    diff = max_abs_diff(ranks[0]["weights"], solo_weights)
    update = max_abs_diff(start_weights, solo_weights)
    print(f"max |w_dp - w_single| = {diff:.3g} (largest weight update {update:.3g})")
    # Measured 8.2e-7 against an 8e-4 update: the noise of changing micro_batch_size on one rank
    # (12 vs 16: 8.6e-7), i.e. fp32 reduction order amplified by Adam.
    assert diff < 1e-5 and update > 100 * diff

    for dp_m, solo_m in zip(ranks[0]["metrics"], solo_metrics):
        assert dp_m.keys() == solo_m.keys()
        for key, value in solo_m.items():
            assert dp_m[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
        assert ranks[1]["metrics"][0] == ranks[0]["metrics"][0]  # metrics are global on every rank
    # Step 1 of the first rollout is still exact with the batch split across ranks.
    first = ranks[0]["metrics"][0]
    assert first["rollout/log_probs_equal_ref"] == 1.0 and first["train/step1_ppo_kl"] == 0.0

    # Rank 0 alone writes dumps and the checkpoint; the others return the same folder.
    dumps = sorted(p.name for p in (tmp_path / "dumps").iterdir())
    assert dumps == ["rank0_0", "rank0_1"]
    assert ranks[0]["folder"] == ranks[1]["folder"]
    state = torch.load(__import__("io").BytesIO(load_checkpoint(root, "dp", 1)), weights_only=True)
    assert max_abs_diff({k: v for k, v in state["model"].items()}, ranks[0]["weights"]) == 0.0


def test_two_lora_ranks_train_like_one(rollout_refs, tmp_path):
    """model.lora with 2 ranks: the adapter's gradients are all-reduced like full weights (only they train)."""
    pytest.importorskip("peft")
    from rollflow.tasks.train.worker import TrainWorker

    root, refs = rollout_refs
    lora = {"rank": 4, "alpha": 8.0}
    spec = {"root": root, "refs": refs, "dump": str(tmp_path / "dumps"), "lora": lora, "run": "dp-lora"}
    ranks = run_ranks("worker_rank_main", 2, spec, tmp_path)
    solo = TrainWorker(
        MODEL, OptimConfig(**OPTIM), AlgoConfig(), store_root=root, run="solo-lora", lora=LoraSettings(**lora)
    )
    start_weights = solo.named_weights()
    solo_metrics = [solo.train_on_artifact(ArtifactRef.from_dict(ref)) for ref in refs]
    solo_weights = solo.named_weights()
    assert max_abs_diff(ranks[0]["weights"], ranks[1]["weights"]) == 0.0
    diff = max_abs_diff(ranks[0]["weights"], solo_weights)
    assert diff < 1e-5 and max_abs_diff(start_weights, solo_weights) > 100 * diff
    first = ranks[0]["metrics"][0]
    assert first["rollout/log_probs_equal_ref"] == 1.0 and first["train/step1_ppo_kl"] == 0.0
    for key, value in solo_metrics[0].items():
        assert first[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


# -- uneven and empty shards, ranks starting from different weights --------------------------------------


class ToyLM(torch.nn.Module):
    """A model with the HF call signature, small enough to start in a fraction of a second."""

    def __init__(self, seed: int, vocab: int = 13, dim: int = 8):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(vocab, dim)
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return types.SimpleNamespace(logits=self.out(torch.tanh(self.emb(input_ids))))


TOY_ALGOS = [
    AlgoConfig(),
    AlgoConfig(loss_agg_mode="seq-mean-token-mean", kl_loss_coef=0.1, entropy_coef=0.01, use_tis=True, tis_mode="clip"),
]


def toy_samples() -> list[Sample]:
    """5 rows (one group): with 3 steps the mini-batches are 2, 2, 1 rows, so rank 1 gets none in step 3."""
    out = []
    for i in range(5):
        prompt = [1, 2 + i]
        response = [3 + (i * 3 + j) % 9 for j in range(1 + i % 3)]
        out.append(
            Sample(
                group_index=0,
                index=i,
                prompt="p",
                tokens=prompt + response,
                response="r",
                response_length=len(response),
                loss_mask=[1] * len(response),
                rollout_log_probs=[-2.5] * len(response),
                reward=float(i % 2),
            )
        )
    return out


def toy_train(backend) -> list[dict[str, float]]:
    from rollflow.tasks.train.step import train_on_samples

    return [train_on_samples(backend, toy_samples(), algo, group_size=5).metrics for algo in TOY_ALGOS]


TOY_OPTIM = dict(num_steps_per_rollout=3, micro_batch_size=1, lr=1e-2)


def toy_rank_main(spec_json: str) -> None:
    from rollflow.tasks.train.data_parallel import destroy_data_parallel
    from rollflow.tasks.train.torch_backend import TorchBackend

    spec = json.loads(spec_json)
    dp = DataParallel(rank=spec["rank"], world_size=spec["world"], master_addr="127.0.0.1", master_port=spec["port"])
    # Different initial weights per rank: construction must broadcast rank 0's.
    backend = TorchBackend(ToyLM(seed=spec["rank"] + 1), OptimConfig(**TOY_OPTIM), dp=dp)
    initial = backend.named_weights()
    metrics = toy_train(backend)
    torch.save({"initial": initial, "weights": backend.named_weights(), "metrics": metrics}, spec["out"])
    destroy_data_parallel()


def test_uneven_and_empty_shards_and_broadcast(tmp_path):
    from rollflow.tasks.train.torch_backend import TorchBackend

    ranks = run_ranks("toy_rank_main", 2, {}, tmp_path)
    solo = TorchBackend(ToyLM(seed=1), OptimConfig(**TOY_OPTIM))
    assert max_abs_diff(ranks[1]["initial"], solo.named_weights()) == 0.0  # rank 0's weights everywhere
    solo_metrics = toy_train(solo)
    assert max_abs_diff(ranks[0]["weights"], ranks[1]["weights"]) == 0.0
    assert max_abs_diff(ranks[0]["weights"], solo.named_weights()) < 1e-6
    for dp_m, solo_m in zip(ranks[0]["metrics"], solo_metrics):
        assert dp_m.keys() == solo_m.keys()
        for key, value in solo_m.items():
            assert dp_m[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_a_whole_state_trainer_refuses_a_sharded_checkpoint(tmp_path):
    """A distributed (sharded megatron) checkpoint resumed by a trainer that holds the whole state: one clear line
    naming the fix, not an unpickling error."""
    from rollflow.tasks.train.checkpoint import DIST_CHECKPOINT_FORMAT, save_checkpoint
    from rollflow.tasks.train.worker import TrainWorker

    payload = json.dumps({"format": DIST_CHECKPOINT_FORMAT, "dir": "dist"}).encode()
    save_checkpoint(str(tmp_path), "r", 1, payload)
    with pytest.raises(ValueError, match=r"checkpoint 1 of run 'r' is a sharded megatron trainer's .*trainer_gpus"):
        TrainWorker(MODEL, OptimConfig(), AlgoConfig(), store_root=str(tmp_path), run="r", resume_iteration=1)
