"""SGLang engines on Ray, through the real machinery: one server actor per engine (each launching a
server process that speaks SGLang's protocol: the FAKE server, tests/fake_sglang_server.py), placed in
its placement-group bundle(s) and seeing exactly its GPUs (Ray-only GPUs of the `ray_local` cluster:
ids without CUDA behind them), a rollout worker balancing over them, abort through the actor's
control group while a rollout runs, and a dead server actor detected and restarted.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import small_config, watching_syncs
from tests.test_sglang_contract import fake_launcher


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def _fake_state(url: str) -> dict:
    import httpx

    return httpx.get(f"{url}/_fake/state", timeout=10).json()


def _sglang_cfg(tmp_path, run: str, *, resources: dict, launcher_args=(), **rollout):
    return small_config(
        tmp_path,
        run=run,
        debug={"rollout_only": True},
        data={"prompts_per_rollout": 8},
        resources=resources,
        # The fake server samples from no model: the post-sync probe has nothing to compare with.
        watchdog={"probe_every": 0},
        rollout={
            "engine": "sglang",
            "n_samples_per_prompt": 2,
            "sglang": {"launcher": fake_launcher(*launcher_args), "startup_timeout_s": 60, **rollout},
        },
    )


def test_two_engines_in_their_bundles_see_exactly_their_gpus_and_share_the_rollout(tmp_path, ray_local):
    import ray

    from rollflow.flows.group import WorkerGroup, server_role
    from rollflow.infra.workers import get_actor

    run = f"sg2-{uuid.uuid4().hex[:8]}"
    # rollout only: engines 2 x 2 GPUs = 4 bundles of the Ray GPUs (ids 0-3)
    cfg = _sglang_cfg(tmp_path, run, resources={"num_gpus": 4, "num_engines": 2, "gpus_per_engine": 2})
    assert cfg.rollout.sglang.tp_size == 2  # taken from resources.gpus_per_engine
    group = WorkerGroup.for_run(cfg)
    try:
        pg = group.start_placement()
        assert pg is not None
        engine = group.start_engine(None)
        infos = [group.server(k).info() for k in range(2)]
        seen = [_environ(info.pid)["CUDA_VISIBLE_DEVICES"].split(",") for info in infos]
        # each server process sees exactly its two bundles' GPUs; together all four, none shared
        assert [len(s) for s in seen] == [2, 2] and sorted(seen[0] + seen[1]) == ["0", "1", "2", "3"]
        for info in infos:
            assert "--tp-size" in info.command and info.command[info.command.index("--tp-size") + 1] == "2"
            assert "--base-gpu-id" not in info.command  # visible devices start at the engine's first GPU
        # the actors sit in the engines' bundles: 0 for engine 0, 2 for engine 1
        table = ray.util.placement_group_table(pg)
        assert len(table["bundles"]) == 4

        samples = engine.rollout(0)
        assert len(samples) == 16
        generated = [_fake_state(info.url)["generated"] for info in infos]
        assert all(g > 0 for g in generated) and sum(generated) == 16, generated  # load balanced over both
        assert engine.describe().backend == "sglang" and group.engine().alive()
    finally:
        group.stop_all()
    assert group.placement_group() is None
    assert get_actor(run, server_role(0)) is None and get_actor(run, server_role(1)) is None


def test_abort_through_the_actor_while_a_rollout_runs(tmp_path, ray_local):
    from rollflow.artifacts.sample import Status
    from rollflow.flows.group import WorkerGroup

    run = f"sgab-{uuid.uuid4().hex[:8]}"
    cfg = _sglang_cfg(tmp_path, run, resources={}, launcher_args=("--step-delay", "0.05"), max_inflight=4)
    cfg.rollout.max_new_tokens = 200  # ~10 s per sample unless aborted
    group = WorkerGroup.for_run(cfg)
    try:
        engine = group.start_engine(None)
        pending = engine.start_rollout(0)
        deadline = time.monotonic() + 30
        while not engine.inflight() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.inflight(), "no request in flight"
        t0 = time.monotonic()
        assert group.abort_rollout() >= 1
        samples = pending.result(timeout=60)
        assert time.monotonic() - t0 < 20
        statuses = [s.status for s in samples]
        assert len(samples) == 16 and statuses.count(Status.ABORTED) == 16, statuses
    finally:
        group.stop_all()


def test_a_dead_server_actor_is_reported_and_ensure_engine_restarts_all(tmp_path, ray_local):
    from rollflow.flows.group import WorkerGroup, server_role
    from rollflow.infra.workers import stop_actor
    from rollflow.tasks.rollout.sglang.server import EngineDiedError

    run = f"sgdead-{uuid.uuid4().hex[:8]}"
    cfg = _sglang_cfg(tmp_path, run, resources={"num_engines": 2})
    group = WorkerGroup.for_run(cfg)
    try:
        engine = group.start_engine(None)
        old = [group.server(k).info().pid for k in range(2)]
        stop_actor(run, server_role(1))  # the actor (and with it its server process) is gone
        assert not engine.alive()
        with pytest.raises(Exception) as err:
            engine.rollout(0)
        assert isinstance(
            err.value.cause if hasattr(err.value, "cause") else err.value, EngineDiedError
        ) or "died" in str(err.value)
        healed = group.ensure_engine(0)
        new = [group.server(k).info().pid for k in range(2)]
        assert set(new).isdisjoint(old)
        assert len(healed.rollout(0)) == 16 and group.engine().alive()
    finally:
        group.stop_all()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["distributed", "tensor", "disk"])
def test_rl_train_on_sglang_engines_syncs_by_each_path(mode, tmp_path, prefect_api, ray_local):
    """Two RL iterations through Prefect with SGLang-protocol engines (fake servers, 2 engines): the
    trainer actor drives the sync - `distributed`: it joins a gloo weight-update group with both
    servers once and broadcasts every bucket; `tensor`: it serializes each bucket itself (CPU tensors
    go by value; on GPUs these are CUDA IPC handles); `disk`: the engine writes safetensors. Parity
    then reads every tensor's head back from BOTH servers."""
    from rollflow.flows.group import WorkerGroup
    from rollflow.flows.reporting import read_metrics
    from rollflow.flows.train import rl_train

    run = f"sgsync-{mode}-{uuid.uuid4().hex[:6]}"
    cfg = small_config(
        tmp_path,
        run=run,
        iterations=2,
        eval_every=0,
        data={"prompts_per_rollout": 4},
        resources={"num_engines": 2},
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
        train={"lr": 1e-2},
    )
    states: list[dict] = []

    def observe(cfg_, out):
        group = WorkerGroup.for_run(cfg_)
        states.append([_fake_state(group.server(k).url()) for k in range(2)])

    with watching_syncs(observe):
        rl_train(cfg)
    rows = read_metrics(cfg)
    assert [r["sync/weight_version"] for r in rows] == [1, 2] and all(r["sync/parity_ok"] == 1.0 for r in rows)
    assert len(states) == 2
    for version, per_server in enumerate(states, start=1):
        for state in per_server:
            checker = [c[2]["action"] for c in state["calls"] if c[1] == "/weights_checker"]
            # startup whole-tensor check (snapshot, randomise, sync, compare), then checksums per sync
            assert checker[:3] == ["snapshot", "reset_tensors", "compare"] and checker[3:] == ["checksum"] * version
            assert state["weight_version"] == str(version)
            paths = [p for p in state["paths"] if p.startswith(("/update_weights", "/init_weights"))]
            if mode == "distributed":
                # the group is joined once, at the first sync; the second reuses it
                assert paths.count("/init_weights_update_group") == 1
                assert "/update_weights_from_distributed" in paths and len(state["received"]) > 0
            elif mode == "tensor":
                assert "/update_weights_from_tensor" in paths
            else:
                assert "/update_weights_from_disk" in paths


@pytest.mark.slow
def test_weight_update_check_names_the_tensor_an_engine_did_not_take(tmp_path, prefect_api, ray_local):
    """debug.check_weight_update_equal at startup: the second engine drops one tensor of every update
    (a name-mapping bug); the run fails before its first step, naming that tensor."""
    from rollflow.flows.train import rl_train

    run = f"sgcheck-{uuid.uuid4().hex[:6]}"
    cfg = small_config(
        tmp_path,
        run=run,
        iterations=1,
        eval_every=0,
        data={"prompts_per_rollout": 4},
        resources={"num_engines": 1},
        debug={"check_weight_update_equal": True},
        # The fake server samples from no model: the post-sync probe has nothing to compare with.
        watchdog={"probe_every": 0},
        rollout={
            "engine": "sglang",
            "n_samples_per_prompt": 2,
            "sglang": {
                "launcher": fake_launcher("--ignore-update-of", "model.norm.weight"),
                "startup_timeout_s": 60,
                "weight_sync": "tensor",
            },
        },
    )
    with pytest.raises(Exception, match=r"weight update check FAILED.*model\.norm\.weight"):
        rl_train(cfg)
