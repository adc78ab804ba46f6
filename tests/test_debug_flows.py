"""rollout_only / replay_train through a real Prefect API and real local Ray (issue 3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollflow.artifacts import RolloutStore
from tests.conftest import small_config

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def record_roles(monkeypatch):
    """Which actor roles the flows start (to prove rollout-only has no trainer, replay no engine)."""
    import rollflow.flows.group

    roles: list[str] = []
    real = rollflow.flows.group.start_actor

    def recording(run_name, role, cls, *args, **kwargs):
        roles.append(role)
        return real(run_name, role, cls, *args, **kwargs)

    monkeypatch.setattr(rollflow.flows.group, "start_actor", recording)
    return roles


def test_rollout_only_then_replay_pinned(tmp_path, prefect_api, ray_local, record_roles):
    from rollflow.flows.debug import replay_train, rollout_only

    cfg = small_config(tmp_path, run="dbg", iterations=2, debug={"rollout_only": True})
    out = rollout_only(cfg)
    assert record_roles == ["engine"]
    assert RolloutStore(str(tmp_path)).list_ids("dbg", "train") == [0, 1]
    assert set(out["rollouts"]) == {0, 1}

    record_roles.clear()
    replay_cfg = small_config(tmp_path, run="dbg-replay", debug={"train_only": True})
    first = replay_train(replay_cfg, rollout_ids=[0, 1], source_run="dbg")
    assert record_roles == ["trainer"]
    steps = first["steps"]
    assert [s["rollout_id"] for s in steps] == [0, 1]
    assert steps[0]["rollout/log_probs_equal_ref"] == 1.0 and steps[0]["train/ppo_kl"] == 0.0
    assert not any(s["cached"] for s in steps)
    # Nothing was generated for the replay run.
    assert RolloutStore(str(tmp_path)).list_ids("dbg-replay", "train") == []

    # Identical replay: every train task is a Prefect cache hit, with the same metrics.
    second = replay_train(replay_cfg, rollout_ids=[0, 1], source_run="dbg")
    assert all(s["cached"] for s in second["steps"])
    assert _metrics(second) == _metrics(first)

    # Same inputs without the cache: bit-identical metrics (deterministic on CPU with a fixed seed).
    third = replay_train(replay_cfg, rollout_ids=[0, 1], source_run="dbg", use_cache=False)
    assert not any(s["cached"] for s in third["steps"])
    assert _metrics(third) == _metrics(first)

    # A different learning rate is a different computation: cache miss.
    lr_cfg = small_config(tmp_path, run="dbg-replay", debug={"train_only": True}, train={"lr": 1e-4})
    fourth = replay_train(lr_cfg, rollout_ids=[0], source_run="dbg")
    assert not fourth["steps"][0]["cached"]

    # The task states in the API say Cached for the second run's train tasks.
    import anyio
    from prefect import get_client

    async def cached_count() -> int:
        async with get_client() as client:
            runs = await client.read_task_runs()
            return sum(1 for r in runs if r.name.startswith("replay-train") and r.state and r.state.name == "Cached")

    assert anyio.run(cached_count) >= 2


def _metrics(result: dict) -> list[dict]:
    return [{k: v for k, v in s.items() if k.startswith(("train/", "rollout/"))} for s in result["steps"]]


def test_replay_unknown_id_lists_existing(tmp_path, prefect_api, ray_local):
    from rollflow.artifacts import ArtifactNotFound
    from rollflow.flows.debug import replay_train, rollout_only

    rollout_only(small_config(tmp_path, run="few", iterations=1, debug={"rollout_only": True}))
    with pytest.raises(ArtifactNotFound) as err:
        replay_train(small_config(tmp_path, run="few", debug={"train_only": True}), rollout_ids=[7])
    assert "0" in str(err.value) and "7" in str(err.value)


def test_cli_rollout_then_replay(tmp_path, prefect_api):
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    common = [
        "--set",
        "run=cli",
        "--set",
        f"store.root={tmp_path}",
        "--set",
        "iterations=2",
        "--set",
        "data.prompts_per_rollout=16",
        "--set",
        "rollout.n_samples_per_prompt=4",
        "--set",
        "train.num_steps_per_rollout=1",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "rollflow.flows.cli", "rollout", *common],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert RolloutStore(str(tmp_path)).list_ids("cli", "train") == [0, 1]
    rep = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollflow.flows.cli",
            "replay",
            *common,
            "--ids",
            "0-1",
            "--dump-details",
            str(tmp_path / "dump"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert rep.returncode == 0, rep.stdout[-2000:] + rep.stderr[-2000:]
    result = json.loads(rep.stdout[rep.stdout.index("{") :])
    assert [s["rollout_id"] for s in result["steps"]] == [0, 1]
    import pyarrow.parquet as pq

    dump = pq.read_table(tmp_path / "dump" / "cli" / "train_dumps" / "000000.parquet")
    assert {"log_probs", "ref_log_probs", "rollout_log_probs", "advantages", "returns", "loss_mask"} <= set(
        dump.column_names
    )
    assert dump.num_rows == 16 * 4

    # `show` reads the dump folder: the copied rollout and the per-token train dump.
    shown = subprocess.run(
        [sys.executable, "-m", "rollflow.flows.cli", "show", str(tmp_path / "dump" / "cli"), "--id", "0", "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    doc = json.loads(shown.stdout)
    assert doc["rollout_id"] == 0 and doc["train_dump"]["rows"] == 16 * 4
    # Step 1 of the replay: old and reference log-probs are the same numbers.
    assert doc["train_dump"]["max_abs_log_probs_minus_ref"] == 0.0


def test_replay_slime_dump_with_extra_fields(tmp_path, prefect_api, ray_local, record_roles):
    """A slime-format dump (string statuses, unknown fields) replays with no engine."""
    import torch

    from rollflow.flows.debug import replay_train
    from rollflow.tasks.rollout.rewards import resolve_reward_fn, score_samples
    from rollflow.tasks.rollout.settings import DataConfig, RolloutConfig
    from rollflow.tasks.rollout.worker import RolloutWorker

    worker = RolloutWorker("builtin:addition", RolloutConfig(n_samples_per_prompt=4), DataConfig(prompts_per_rollout=8))
    for rid in (0, 1):
        samples = score_samples(worker.rollout(rid), resolve_reward_fn("addition"))
        dicts = []
        for s in samples:
            d = s.to_dict()
            d["status"] = "Status." + d["status"].upper()  # as slime's enum str() writes it
            d["weight_versions"] = [str(d.pop("weight_version"))]
            d["spec_info"] = {"accept_len": 3}  # a field rollflow does not know
            d.pop("reward_key")
            dicts.append(d)
        torch.save({"rollout_id": rid, "samples": dicts}, tmp_path / f"data_{rid}.pt")
    template = str(tmp_path / "data_{rollout_id}.pt")
    cfg = small_config(tmp_path / "store", run="slime-replay", debug={"load_debug_rollout_data": template})
    assert cfg.debug.train_only
    out = replay_train(cfg)
    assert record_roles == ["trainer"]
    assert [s["rollout_id"] for s in out["steps"]] == [0, 1]
    assert out["steps"][0]["train/ppo_kl"] == 0.0
    # Imported once as artifacts of the replay run; the unknown field survived in metadata.
    art = RolloutStore(str(tmp_path / "store")).load("slime-replay", "train", 1)
    assert art.samples[0].metadata["extra_fields"]["spec_info"] == {"accept_len": 3}
