"""SGLang 0.5.23's weight-update and memory protocol, as rollflow drives it (fake servers that enforce
the real rules: tests/fake_sglang_server.py, rules and sources in tests/fixtures/sglang_protocol.json).

- tensor / distributed updates only inside a weight-update session; the old session-less sequence is
  refused;
- colocated with several trainer ranks, every engine TP rank takes the flattened bucket made by the
  trainer rank on its own GPU (rl_train, 2 engines x 1 GPU, 2 trainer ranks, Ray-only GPUs);
- a release after an abort waits until the server is idle; a retried resume is a no-op;
- request ids are never prefixes of each other; seeded native n sends n seeds.
"""

from __future__ import annotations

import threading
import time
import types
import uuid

import httpx
import pytest
import torch

from rollflow.tasks.rollout.engine import GenerationRequest, SamplingParams
from rollflow.tasks.rollout.sglang.engine import SGLangEngine
from rollflow.tasks.rollout.sglang.payloads import SGLangRequestError, request_id
from rollflow.tasks.sync import ipc
from rollflow.tasks.sync.ipc import FLATTENED_BUCKET, flatten_bucket, serialize_flattened_bucket
from tests.conftest import small_config, watching_syncs
from tests.fake_sglang_server import FAKE_START_S, FakeSGLang
from tests.test_sglang_contract import BUILTIN, builtin_weights, fake_launcher


def _payload(named) -> str:
    import base64

    return base64.b64encode(serialize_flattened_bucket(*flatten_bucket(list(named.items())))).decode()


def test_the_fake_refuses_the_session_less_sequence_and_takes_the_session_one():
    w = builtin_weights(2)
    with FakeSGLang(model_path=str(BUILTIN)) as fake:
        engine = SGLangEngine([fake.url])
        # 0.5.x before sessions: POST /update_weights_from_tensor straight away
        with pytest.raises(SGLangRequestError, match="must run between begin_weight_update"):
            engine.apply_serialized_bucket([_payload(w)], last=True, weight_version=1, load_format=FLATTENED_BUCKET)
        r = httpx.post(f"{fake.url}/end_weight_update", json={}, timeout=10)  # SGLang answers, and lives on
        assert r.status_code == 400 and "no weight-update session is open" in r.json()["message"]
        engine.update_weights_from_tensor(w, 1)  # begin -> tensor -> end
        assert [p for p in fake.paths() if "weight" in p][-3:] == [
            "/begin_weight_update",
            "/update_weights_from_tensor",
            "/end_weight_update",
        ]
        assert fake.weight_version == "1" and not fake.session_open
        # a session this engine left open is ended before the next begin: SGLang is never asked to begin twice
        engine.begin_weight_update()
        refused = len(fake.refusals)
        engine.update_weights_from_tensor(w, 1)
        assert not fake.session_open and len(fake.refusals) == refused
        # the fake is stricter than Qwen2's load_weights (which only logs an unknown name): a 400
        with pytest.raises(SGLangRequestError, match="unknown parameter 'model.nope'"):
            engine.update_weights_from_tensor({"model.nope": torch.zeros(2)}, 1)
        assert not fake.session_open  # closed again after the failure


def test_a_session_opened_before_an_actor_restart_is_ended_on_sglangs_400():
    """A restarted engine actor cannot know of a session its predecessor left open: SGLang's 400
    'already open' (a polite answer, its server lives on) is the one answer it ends and begins on."""
    w = builtin_weights(2)
    with FakeSGLang(model_path=str(BUILTIN)) as fake:
        SGLangEngine([fake.url]).begin_weight_update()  # the actor that died holding a session
        engine = SGLangEngine([fake.url])
        engine.update_weights_from_tensor(w, 1)
        assert fake.refusals == [
            ("/begin_weight_update", "a weight-update session is already open; call end_weight_update() first")
        ]
        assert not fake.session_open and fake.weight_version == "1" and not fake.dead


def test_the_fake_dies_where_sglangs_scheduler_raises():
    """Each of these raises inside SGLang 0.5.23's scheduler (scheduler_components/weight_updater.py;
    model loaders), which ends the server: the request gets no answer and the server answers nothing after."""
    w = builtin_weights(2)
    name = next(iter(w))

    def dead_after(fake, call) -> str:
        with pytest.raises(httpx.TransportError):
            call()
        assert fake.dead
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{fake.url}/health", timeout=5)
        return fake.refusals[-1][1]

    with FakeSGLang(model_path=str(BUILTIN)) as fake:  # a tensor of another shape: weight_loader asserts
        engine = SGLangEngine([fake.url])
        with pytest.raises(SGLangRequestError, match="RemoteProtocolError"):
            engine.update_weights_from_tensor({name: torch.zeros(3, 3)}, 1)
        assert fake.dead and "AssertionError" in fake.refusals[-1][1]
    with FakeSGLang() as fake:  # resume of a tag that is not released: offload_tags.remove raises KeyError
        message = dead_after(
            fake, lambda: httpx.post(f"{fake.url}/resume_memory_occupation", json={"tags": ["weights"]})
        )
        assert message.startswith("KeyError")
    with FakeSGLang(step_delay_s=0.05) as fake:  # release on a busy server: `assert is_fully_idle()`
        threading.Thread(
            target=lambda: httpx.post(
                f"{fake.url}/generate",
                json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 100}},
                timeout=30,
            ),
            daemon=True,
        ).start()
        deadline = time.monotonic() + 10
        while not fake.inflight and time.monotonic() < deadline:
            time.sleep(0.01)
        message = dead_after(
            fake, lambda: httpx.post(f"{fake.url}/release_memory_occupation", json={"tags": ["kv_cache"]})
        )
        assert "should be called only when server is idle" in message


def test_release_after_an_abort_waits_for_idle_and_a_retried_resume_is_a_no_op():
    """Acceptance 3: aborted requests keep the scheduler busy for a while (abort_linger_s); the release
    flushes until the server answers 200, then releases every tag; resuming twice sends one resume."""
    with FakeSGLang(vocab_size=15, step_delay_s=0.02, abort_linger_s=0.6) as fake:
        engine = SGLangEngine([fake.url], max_inflight=4)
        out: list = []
        worker = threading.Thread(
            target=lambda: out.append(
                engine.generate([GenerationRequest([1, 4, 5], n=2)], SamplingParams(max_new_tokens=200))
            )
        )
        worker.start()
        deadline = time.monotonic() + 20
        while len(fake.inflight) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fake.inflight, "no request in flight"
        engine.abort()
        t0 = time.monotonic()
        engine.offload()  # the aborted requests are still running on the server
        waited = time.monotonic() - t0
        worker.join(timeout=30)
        assert fake.flush_attempts >= 2 and waited >= 0.3, (fake.flush_attempts, waited)
        assert not fake.refusals and sorted(fake.released) == ["cuda_graph", "kv_cache", "weights"]
        assert [o.finish_reason for o in out[0][0]] == ["abort", "abort"]

        engine.onload_weights()
        engine.onload_weights()  # a Prefect retry of the resume task: nothing left to resume
        resumes = [b for _, p, b in fake.calls() if p == "/resume_memory_occupation"]
        assert resumes == [{"tags": ["weights"]}]
        engine.resume_memory(["kv_cache"])  # what rl_iteration asks after the sync: the CUDA graphs come too
        assert [b for _, p, b in fake.calls() if p == "/resume_memory_occupation"][-1] == {
            "tags": ["kv_cache", "cuda_graph"]
        }
        assert not fake.refusals and not fake.released


def test_request_ids_are_never_prefixes_and_seeded_native_n_sends_n_seeds():
    ids = [request_id("rf1-2-ab", i, j) for i in range(12) for j in range(12)] + [
        request_id("rf1-2-ab", i) for i in range(12)
    ]
    assert not [(a, b) for a in ids for b in ids if a != b and b.startswith(a)]
    with FakeSGLang(vocab_size=15) as fake:
        engine = SGLangEngine([fake.url], n_mode="native", seeded=True)
        out = engine.generate([GenerationRequest([1, 4], n=3)], SamplingParams(max_new_tokens=3, seed=7))
        body = fake.calls("/generate")[0][2]
        seeds = [sp["sampling_seed"] for sp in body["sampling_params"]]
        assert len(set(seeds)) == 3 and len(body["input_ids"]) == 3 and len(out[0]) == 3
        assert all(r.startswith(body["rid"][0][:-2]) for r in body["rid"]) and len(set(body["rid"])) == 3


@pytest.mark.slow
def test_rl_train_colocated_two_engines_two_trainer_ranks_sync_by_ipc_in_sessions(tmp_path, prefect_api, ray_local):
    """Acceptance 2: placement=colocate, 2 engines x 1 GPU sharing their GPUs with 2 trainer ranks (Ray-only
    GPUs), offload on: the startup whole-tensor check and each iteration's sync run through tensor/IPC in
    a weight-update session per server, and each engine takes the payload of the trainer rank on its GPU."""
    from rollflow.flows.group import WorkerGroup
    from rollflow.flows.reporting import read_metrics
    from rollflow.flows.train import rl_train

    run = f"sgcolo-{uuid.uuid4().hex[:6]}"
    cfg = small_config(
        tmp_path,
        run=run,
        iterations=1,
        eval_every=0,
        data={"prompts_per_rollout": 4},
        placement="colocate",
        offload=True,
        debug={"check_weight_update_equal": True},
        resources={"num_gpus": 2, "trainer_gpus": 2, "num_engines": 2, "gpus_per_engine": 1},
        rollout={
            "engine": "sglang",
            "n_samples_per_prompt": 2,
            "sglang": {"launcher": fake_launcher(), "startup_timeout_s": FAKE_START_S, "bucket_mb": 1},
        },
    )
    assert cfg.rollout.sglang.weight_sync == "tensor" and cfg.rollout.sglang.dtype == "bfloat16"
    assert cfg.rollout.sglang.mem_fraction_static == 0.5  # colocated default beside the trainer's share
    seen: list = []

    def observe(cfg_, out):
        group = WorkerGroup.for_run(cfg_)
        servers = [group.server(k) for k in range(2)]
        seen.append(
            {
                "out": out,
                "trainer_gpus": group.trainer().gpu_ids(),
                "server_gpus": [s.info().gpu_ids for s in servers],
                "states": [httpx.get(f"{s.url()}/_fake/state", timeout=10).json() for s in servers],
            }
        )

    with watching_syncs(observe):
        rl_train(cfg)
    rows = read_metrics(cfg)
    assert rows[-1]["sync/parity_ok"] == 1.0 and rows[-1]["sync/weight_version"] == 1
    (sync,) = seen
    assert sync["out"]["sync_mode"] == "tensor"
    sources, trainer_gpus, server_gpus = sync["out"]["sync_sources"], sync["trainer_gpus"], sync["server_gpus"]
    assert len(set(trainer_gpus)) == 2 and [len(g) for g in server_gpus] == [1, 1]
    # engine k's only TP rank took the payload of the trainer rank on engine k's GPU, not rank 0's
    assert sorted(sources) == [0, 1] and [trainer_gpus[r] for r in sources] == [g[0] for g in server_gpus]
    for state in sync["states"]:
        assert not state["refusals"], state["refusals"]
        calls = [(p, b) for _, p, b in state["calls"]]
        updates = [i for i, (p, _) in enumerate(calls) if p == "/update_weights_from_tensor"]
        begins = [i for i, (p, _) in enumerate(calls) if p == "/begin_weight_update"]
        ends = [i for i, (p, _) in enumerate(calls) if p == "/end_weight_update"]
        assert len(begins) == len(ends) == 2  # the startup check's re-sync, then iteration 1's sync
        assert all(any(b < u < e for b, e in zip(begins, ends)) for u in updates) and updates
        assert all(calls[u][1]["load_format"] == "flattened_bucket" for u in updates)
        checker = [b["action"] for p, b in calls if p == "/weights_checker"]
        assert checker[:3] == ["snapshot", "reset_tensors", "compare"]
        paths = [p for p, _ in calls]
        # colocation order around the sync: release (on an idle server) ... resume weights, update, resume KV
        release = paths.index("/release_memory_occupation")
        assert paths[release - 1] == "/flush_cache" and release < begins[1]
        # seen from inside the sync task: the weights are back, the KV cache and CUDA graphs not yet
        assert state["weight_version"] == "1" and state["released"] == ["cuda_graph", "kv_cache"]


def test_engine_dtype_memory_share_and_allocator_env_defaults(tmp_path, monkeypatch):
    from pathlib import Path

    from rollflow.flows.config_loading import ConfigError, load_config
    from rollflow.tasks.rollout.sglang.from_config import dropped_env, launch_spec_for
    from rollflow.tasks.rollout.sglang.server import SGLangServer

    cfg = load_config(None, ["rollout.engine=sglang"])
    assert cfg.rollout.sglang.dtype == "bfloat16" and cfg.rollout.sglang.mem_fraction_static is None
    assert any("SGLang engines run bfloat16 while the trainer runs float32" in n for n in cfg.notices)
    assert load_config(None, ["rollout.engine=sglang", "rollout.dtype=float32"]).rollout.sglang.dtype == "float32"
    colo = [
        "rollout.engine=sglang",
        "placement=colocate",
        "offload=true",
        "resources.num_gpus=1",
        "resources.trainer_gpus=1",
        "resources.gpus_per_engine=1",
    ]
    cfg = load_config(None, colo)
    assert cfg.rollout.sglang.mem_fraction_static == 0.5 and cfg.rollout.sglang.memory_saver
    with pytest.raises(
        ConfigError,
        match=r"mem_fraction_static=0.8 \+ rollout.sglang.colocate_trainer_fraction=0.4 "
        r"> 0.9.*set mem_fraction_static <= 0.5",
    ):
        load_config(None, colo + ["rollout.sglang.mem_fraction_static=0.8"])
    # one trainer rank cannot feed colocated engines on other GPUs: refused before any worker starts
    with pytest.raises(ConfigError, match="engines 2 x 1 = 2 GPUs must equal trainer 1 GPUs"):
        load_config(None, colo + ["resources.num_gpus=2", "resources.num_engines=2"])

    # the memory-saver server does not inherit the trainer's allocator settings
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    spec = launch_spec_for(BUILTIN, cfg.rollout, port=None)
    spec = type(spec)(**{**spec.__dict__, "launcher": tuple(fake_launcher())})
    with SGLangServer(spec, log_path=tmp_path / "s.log", drop_env=dropped_env(cfg.rollout)).start() as server:
        server.wait_healthy(timeout=FAKE_START_S)
        raw = Path(f"/proc/{server.proc.pid}/environ").read_bytes().split(b"\0")
        env = dict(item.decode().split("=", 1) for item in raw if b"=" in item)
        assert "PYTORCH_CUDA_ALLOC_CONF" not in env and env["PYTHONUNBUFFERED"] == "1"
    assert dropped_env(load_config(None, ["rollout.engine=sglang"]).rollout) == ()


def test_an_engine_local_tensor_update_serializes_once_per_tp_rank(monkeypatch):
    """CUDA IPC refcounts are per serialization and each TP rank releases its own: the engine's own tensor
    path (an engine starting from checkpoint weights with tensor sync) makes one per rank, like the trainer's."""
    from rollflow.tasks.rollout.sglang import weight_receiver

    made = []
    original = weight_receiver.serialize_flattened_bucket

    def counting(flat, entries):
        made.append(len(entries))
        return original(flat, entries)

    monkeypatch.setattr(weight_receiver, "serialize_flattened_bucket", counting)
    w = builtin_weights(2)
    with FakeSGLang(model_path=str(BUILTIN), tp_size=2) as a, FakeSGLang(model_path=str(BUILTIN)) as b:
        engine = SGLangEngine([a.url, b.url], tp_sizes=[2, 1], bucket_bytes=1 << 40)
        engine.update_weights_from_tensor(w, 1)
        assert len(made) == 3  # one bucket, TP ranks 2 + 1
        custom = []
        engine.update_weights_from_tensor(
            w,
            1,
            serializer=lambda bucket: custom.append(1) or ipc.serialize_named_tensors(bucket),
            load_format=None,
        )
        assert len(custom) == 3
        assert not a.refusals and not b.refusals and a.weight_version == b.weight_version == "1"


class _SyncEngine:
    """An EngineClient stand-in that records the session calls."""

    def __init__(self, mode: str):
        self.mode, self.calls = mode, []

    def payloads_per_bucket(self):
        return 1

    def begin_weight_update(self):
        self.calls.append("begin")

    def end_weight_update(self, timeout=None):
        self.calls.append(("end", timeout))

    def apply_serialized_bucket(self, *args):
        self.calls.append("bucket")
        return 1

    def in_weight_group(self, name):
        return True

    def receive_weight_bucket(self, *args):
        self.calls.append("bucket")
        return types.SimpleNamespace(result=lambda: 1)


class _FailingTrainer:
    """A TrainerClient stand-in whose second bucket fails."""

    def __init__(self):
        self.n, self.ended = 0, False

    def gpu_ids(self):
        return [None]

    def ipc_begin_ranks(self, *args, **kwargs):
        pass

    def ipc_end_ranks(self, ranks):
        self.ended = True

    def weight_buckets_begin(self, *args):
        pass

    def _next(self):
        self.n += 1
        if self.n == 2:
            raise RuntimeError("trainer failed mid-sync")

    def ipc_next_ranks(self, ranks):
        self._next()
        return {0: types.SimpleNamespace(last=False, nbytes=1, payloads=["p"])}

    def next_weight_bucket(self):
        self._next()
        return [], False

    def broadcast_weight_bucket(self, device):
        return 1


@pytest.mark.parametrize("mode", ["tensor", "distributed"])
def test_a_sync_that_fails_mid_way_ends_its_session(mode):
    """Left open, the session would refuse the next sync's begin; ended (bounded: the engine may still be
    inside the failed bucket), and the sync's own error is the one raised."""
    from rollflow.flows.config_loading import load_config
    from rollflow.flows.weight_sync.distributed import push_distributed
    from rollflow.flows.weight_sync.shared import END_AFTER_FAILURE_S
    from rollflow.flows.weight_sync.tensor import push_tensor

    cfg = load_config(None, ["rollout.engine=sglang"])
    engine, trainer = _SyncEngine(mode), _FailingTrainer()
    push = push_tensor if mode == "tensor" else push_distributed
    with pytest.raises(RuntimeError, match="trainer failed mid-sync"):
        push(cfg, trainer, engine, 1)
    assert engine.calls == ["begin", "bucket", ("end", END_AFTER_FAILURE_S)]
    assert trainer.ended or mode == "distributed"


def test_a_restarted_engine_reads_back_the_tags_its_server_has_released(tmp_path):
    """The released tags live with the server process's owner: an engine actor restarted over the same
    server resumes what its predecessor released (a fresh engine would not, and SGLang reports it nowhere),
    and never resumes a tag the server holds (SGLang's scheduler dies on that)."""
    from rollflow.tasks.rollout.sglang.server import LaunchSpec, SGLangServer, free_port

    spec = LaunchSpec(model_path=str(BUILTIN), port=free_port(), launcher=fake_launcher())
    with SGLangServer(spec, log_path=tmp_path / "fake.log").start() as server:
        server.wait_healthy(timeout=FAKE_START_S)
        SGLangEngine([server.url], servers=[server]).offload()  # then the actor dies
        engine = SGLangEngine([server.url], servers=[server])
        assert engine.released[server.url] == {"kv_cache", "weights", "cuda_graph"}
        engine.onload_weights()
        engine.onload_kv_cache()
        state = httpx.get(f"{server.url}/_fake/state", timeout=10).json()
        assert state["released"] == [] and not state["refusals"] and server.memory_released() == []
        SGLangEngine([server.url], servers=[server]).onload_kv_cache()  # nothing released: nothing resumed
        assert server.alive()
