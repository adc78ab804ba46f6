"""Contract tests judged by SGLang 0.5.23's OWN code (not by rollflow's reading of it).

`make setup` installs `sglang==0.5.23` without its dependencies plus the `sglang-contract` extra, so on
a CPU box these run, in one fake-server process started with `--own-code` (SGLang's modules change
process state, so pytest itself never imports them; tests/sglang_own_code.py says what is used):

- SGLang's argument parser (`prepare_server_args`, what `python -m sglang.launch_server` runs) on
  every command line rollflow builds, and its flag set against the committed list;
- SGLang's request structures on every JSON body rollflow posts: the fake validates each request
  of a real SGLangEngine through them (generate, abort, each weight-update call, memory), plus the
  session bodies; `GenerateReqInput` normalization for rids and seeds;
- SGLang's safe unpickler, CUDA-IPC device mapping and flattened-bucket reconstruction on every IPC
  payload rollflow produces (CPU payloads load for real; CUDA handles are recorded after SGLang's
  patched rebuild has mapped the device UUID, since no GPU is here).

They skip only when sglang is not installed.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import pickle
import time

import httpx
import pytest
import torch

from rollflow.tasks.rollout.engine import GenerationRequest, SamplingParams
from rollflow.tasks.rollout.sglang.engine import SGLangEngine
from rollflow.tasks.rollout.sglang.payloads import SGLangRequestError
from rollflow.tasks.rollout.sglang.server import LaunchSpec, SGLangServer, free_port, launch_command
from rollflow.tasks.rollout.sglang.weights_check import finish_overwrite_check, prepare_overwrite_check
from rollflow.tasks.sync import ipc
from tests.fake_sglang_server import ENDPOINTS
from tests.sglang_own_code import SGLANG_VERSION, tensor_sha
from tests.test_sglang_contract import BUILTIN, builtin_weights, fake_launcher

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None,
    reason=f"sglang is not installed: `make setup` installs it (pip install --no-deps sglang=={SGLANG_VERSION} "
    "plus the sglang-contract extra)",
)


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """A fake server (bf16, the built-in model) that checks every request with SGLang's own objects."""
    spec = LaunchSpec(
        model_path=str(BUILTIN),
        port=free_port(),
        launcher=fake_launcher("--own-code"),
        dtype="bfloat16",
        skip_tokenizer_init=False,
    )
    server = SGLangServer(spec, log_path=tmp_path_factory.mktemp("own") / "fake.log").start()
    try:
        server.wait_healthy(timeout=180)  # SGLang's import takes ~15 s
        client = httpx.Client(base_url=server.url, timeout=60)
        assert client.post("/_fake/own/version").json()["version"] == SGLANG_VERSION
        yield client
    finally:
        server.stop(timeout=10)


def _ask(client, route: str, body: dict):
    r = client.post(f"/_fake/own/{route}", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _state(client) -> dict:
    return client.get("/_fake/state").json()


# ------------------------------------------------------------------------------------------------
# Command lines
# ------------------------------------------------------------------------------------------------


def _configs():
    from rollflow.flows.config_loading import load_config

    yield load_config(None, ["rollout.engine=sglang"])  # defaults: bf16, SGLang's memory share
    yield load_config(
        None,
        [
            "rollout.engine=sglang",
            "placement=colocate",
            "offload=true",
            "resources.num_gpus=2",
            "resources.trainer_gpus=2",
            "resources.num_engines=2",
            "resources.gpus_per_engine=1",
        ],
    )
    yield load_config(
        None,
        [
            "rollout.engine=sglang",
            "rollout.sglang.dtype=float16",
            "rollout.sglang.mem_fraction_static=0.7",
            "rollout.sglang.args.disable-cuda-graph=true",
            "rollout.sglang.args.speculative-algorithm=EAGLE",
            "rollout.sglang.args.moe-a2a-backend=deepep",
            'rollout.sglang.args.lora-paths=["a=/x","b=/y"]',
            "resources.num_gpus=4",
            "resources.trainer_gpus=2",
            "resources.num_engines=1",
            "resources.gpus_per_engine=2",
        ],
    )


def test_every_command_line_rollflow_builds_parses_with_sglangs_parser(own):
    from rollflow.tasks.rollout.sglang.from_config import launch_spec_for

    seen = 0
    for cfg in _configs():
        sg = cfg.rollout.sglang
        spec = launch_spec_for("/models/m", cfg.rollout, port=31000, base_gpu_id=2, weight_version=3)
        argv = launch_command(spec)[3:]  # after `python -m sglang.launch_server`
        args = _ask(own, "server_args", {"argv": argv})
        assert (args["model_path"], args["port"], args["host"]) == ("/models/m", 31000, "127.0.0.1")
        assert args["tp_size"] == (sg.tp_size or 1) and args["dtype"] == sg.dtype
        assert args["mem_fraction_static"] == sg.mem_fraction_static
        assert args["enable_memory_saver"] is sg.memory_saver and args["skip_tokenizer_init"] is True
        assert (args["base_gpu_id"], args["weight_version"]) == (2, "3")
        for key, value in sg.args.items():
            assert args[key.replace("-", "_")] == value, key
        seen += 1
    assert seen == 3
    r = own.post("/_fake/own/server_args", json={"argv": ["--model-path", "m", "--tp-sise", "2"]})
    assert r.status_code == 400  # SGLang's parser refuses what it does not know


def test_committed_flag_list_is_sglangs_parser(own):
    """tasks/rollout/sglang/flags.txt (what config validation checks passthrough flags against) is exactly
    the installed SGLang's parser, and the static extractor that wrote it reads that parser right."""
    import importlib.util
    from pathlib import Path

    from rollflow.tasks.rollout.sglang.flags import extract_flags, load_flags

    live = {flag: tuple(v) for flag, v in _ask(own, "parser_flags", {}).items() if flag not in ("-h", "--help")}
    committed = load_flags()
    assert committed.version == SGLANG_VERSION and len(live) > 500
    assert {f: (s.kind, s.field) for f, s in committed.flags.items()} == live
    root = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
    assert {s.flag: (s.kind, s.field) for s in extract_flags(root)} == live


# ------------------------------------------------------------------------------------------------
# Request bodies: a real SGLangEngine against the fake that checks each one with SGLang's structures
# ------------------------------------------------------------------------------------------------


def test_every_body_rollflow_posts_passes_sglangs_request_structures(own):
    url = str(own.base_url).rstrip("/")
    engine = SGLangEngine([url], max_inflight=4, bucket_bytes=4096, n_mode="native", seeded=True)
    params = SamplingParams(max_new_tokens=3, seed=5, stop_token_ids=[2])
    engine.generate([GenerationRequest([1, 4, 5], n=3), GenerationRequest([1, 6])], params)
    engine.n_mode, engine.seeded = "repeat", False
    engine.generate([GenerationRequest([1, 4, 5], n=2)], SamplingParams(max_new_tokens=2, temperature=0.0))
    engine.offload()
    engine.onload_weights()
    w = builtin_weights(4)
    engine.update_weights_from_tensor(w, 1)
    engine.onload_kv_cache()
    with pytest.raises(SGLangRequestError, match="Get parameter by name failed"):  # Qwen2 has none in 0.5.23
        engine.get_weights_by_name(next(iter(w)))
    prepare_overwrite_check(engine)  # snapshot + reset_tensors
    engine.update_weights_from_tensor(w, 1)
    assert not finish_overwrite_check(engine).ok  # compare: only 4 tensors came back (the check works)
    engine._post(url, "/weights_checker", {"action": "checksum"})
    engine.destroy_weights_update_group("none")
    engine.abort(["rf-none."])
    engine.abort()
    state = _state(own)
    assert {
        "/generate",
        "/abort_request",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/begin_weight_update",
        "/update_weights_from_tensor",
        "/end_weight_update",
        "/weights_checker",
        "/get_weights_by_name",
        "/destroy_weights_update_group",
        "/flush_cache",
    } <= set(state["paths"])
    assert not state["refusals"], state["refusals"]
    judged = [p for _, p, _ in state["calls"] if "fields" in ENDPOINTS[p]]  # GETs without a body aside
    assert state["own_checked"] == judged and len(judged) > 15  # every body went through SGLang's structures


def test_bodies_of_the_other_calls_and_a_typo(own):
    bodies = {
        "/init_weights_update_group": {
            "master_address": "10.0.0.1",
            "master_port": 29500,
            "rank_offset": 1,
            "world_size": 3,
            "group_name": "rollflow-r",
            "backend": "nccl",
        },
        "/update_weights_from_distributed": {
            "names": ["a"],
            "dtypes": ["bfloat16"],
            "shapes": [[2, 3]],
            "group_name": "g",
            "flush_cache": True,
            "weight_version": "2",
        },
        "/update_weights_from_disk": {
            "model_path": "/w/v000001",
            "weight_version": "1",
            "flush_cache": True,
            "abort_all_requests": False,
        },
        "/get_weights_by_name": {"name": "model.norm.weight", "truncate_size": 64},
        "/weights_checker": {"action": "compare"},
        "/begin_weight_update": {},
        "/end_weight_update": {},
        "/open_session": {"capacity_of_str_len": 4096, "session_id": "s1"},
        "/close_session": {"session_id": "s1"},
    }
    for route, body in bodies.items():
        assert _ask(own, "body_errors", {"route": route, "body": body}) == [], route
    typo = _ask(
        own,
        "body_errors",
        {
            "route": "/update_weights_from_tensor",
            "body": {"serialized_named_tensors": [], "load_fromat": "flattened_bucket"},
        },
    )
    assert typo and "load_fromat" in typo[0]
    missing = _ask(own, "body_errors", {"route": "/init_weights_update_group", "body": {"master_address": "x"}})
    assert missing and "master_port" in missing[0]


def test_rids_and_seeds_as_sglang_normalizes_them(own):
    from rollflow.tasks.rollout.sglang.payloads import batch_payload, generate_payload, request_id

    one = _ask(
        own,
        "generate_request",
        {
            "body": generate_payload(
                [1, 4], {"max_new_tokens": 2, "n": 3, "sampling_seed": 9}, request_id("rf1-1-ab", 0)
            )
        },
    )
    assert one["seeds"] == [9, 9, 9]  # why rollflow never sends a seeded native n
    rids = [request_id("rf1-1-ab", 0, j) for j in range(3)]
    many = _ask(
        own,
        "generate_request",
        {"body": batch_payload([1, 4], [{"max_new_tokens": 2, "sampling_seed": s} for s in (9, 10, 11)], rids)},
    )
    assert many["seeds"] == [9, 10, 11] and many["rids"] == rids


# ------------------------------------------------------------------------------------------------
# IPC payloads
# ------------------------------------------------------------------------------------------------


def _named():
    g = torch.Generator().manual_seed(0)
    return [
        ("w", torch.randn(3, 5, generator=g)),
        ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("i", torch.randint(0, 100, (2, 2), generator=g)),
        ("t", torch.randn(4, 6, generator=g).t()),
    ]


def test_cpu_payloads_load_through_sglangs_unpickler(own):
    named = _named()
    for fmt, raw in (
        (ipc.FLATTENED_BUCKET, ipc.serialize_flattened_bucket(*ipc.flatten_bucket(named[:2]))),
        (None, ipc.serialize_named_tensors(named)),
    ):
        out = _ask(own, "payload", {"data": base64.b64encode(raw).decode(), "load_format": fmt})
        assert "error" not in out, out
        expect = named[:2] if fmt else named
        assert [(t["name"], t["sha"]) for t in out["tensors"]] == [(n, tensor_sha(t)) for n, t in expect]
        if fmt:
            assert out["metadata_types"] == ["sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata"]
    for payload in ipc.ipc_buckets(named, 1 << 20, tp_size=2, flattened=True):  # what the trainer sends
        for data in payload.payloads:
            out = _ask(own, "payload", {"data": data, "load_format": ipc.FLATTENED_BUCKET})
            assert [t["name"] for t in out["tensors"]] == payload.names


def _cuda_like_payload(uuid: str) -> str:
    """A flattened-bucket payload whose tensor is a CUDA IPC handle (the reduction torch makes for a CUDA
    tensor, built without a GPU), its device slot holding the GPU's UUID as rollflow writes it."""
    from torch.multiprocessing import reductions

    args = (
        torch.Tensor,
        (16,),
        (1,),
        torch.uint8,
        torch.UntypedStorage,
        0,
        uuid,
        b"handle",
        16,
        0,
        b"ref",
        0,
        b"event",
        False,
    )
    assert args[ipc.DEVICE_SLOT] == uuid

    class Handle:
        def __reduce__(self):
            return reductions.rebuild_cuda_tensor, args

    entry = ipc.FlatEntry("w", torch.Size([4]), torch.float32, 0, 16, 16)
    handle = Handle()

    class Pickler(ipc._FlatPickler):  # rollflow's flattened-bucket pickler, the tensor swapped for the handle
        def reducer_override(self, obj):
            return handle.__reduce__() if obj is handle else super().reducer_override(obj)

    buf = io.BytesIO()
    Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump({"flattened_tensor": handle, "metadata": [entry]})
    return base64.b64encode(buf.getvalue()).decode()


def test_per_gpu_payloads_map_to_each_engine_ranks_own_gpu(own):
    """Trainer rank r on GPU r makes the payload for the engine TP rank on GPU r. SGLang's patched
    rebuild maps the UUID to the index the receiving server sees (its CUDA_VISIBLE_DEVICES); a payload
    from another GPU is SGLang's `Invalid device_uuid` (the server dies on it), as all-from-rank-0 was."""
    gpus = [f"0000000{i}-aaaa-bbbb-cccc-dddddddddddd" for i in range(4)]  # torch's uuid strings
    engines = [[gpus[0], gpus[1]], [gpus[2], gpus[3]]]  # 2 engines x tp 2, each server sees its 2 GPUs
    for _k, visible in enumerate(engines):
        for j, gpu in enumerate(visible):
            out = _ask(
                own,
                "payload",
                {"data": _cuda_like_payload(gpu), "load_format": ipc.FLATTENED_BUCKET, "visible_uuids": visible},
            )
            assert "error" not in out, out
            assert out["opened"][0]["device"] == j and out["tensors"][0]["name"] == "w"
    refused = _ask(
        own,
        "payload",
        {"data": _cuda_like_payload(gpus[0]), "load_format": ipc.FLATTENED_BUCKET, "visible_uuids": engines[1]},
    )
    assert "Invalid device_uuid" in refused["error"]


def test_payloads_name_only_globals_sglang_allows(own):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    data = base64.b64encode(pickle.dumps([("x", Evil())])).decode()
    out = _ask(own, "payload", {"data": data})
    assert "Blocked unsafe global" in out["error"]


# ------------------------------------------------------------------------------------------------
# Scheduler rules: SGLang's own SchedulerWeightUpdaterManager decides, not the fake's copy
# ------------------------------------------------------------------------------------------------


def test_session_and_memory_rules_are_sglangs_own_scheduler_code(tmp_path):
    """The session rules answer 400 and the server lives on; resuming a tag that is not released raises
    inside SGLang's scheduler (KeyError), and the server process ends. An engine drives the session
    calls (its recovery relies only on the 400 SGLang itself sends)."""
    spec = LaunchSpec(model_path=str(BUILTIN), port=free_port(), launcher=fake_launcher("--own-code"))
    server = SGLangServer(spec, log_path=tmp_path / "fake.log").start()
    try:
        server.wait_healthy(timeout=180)
        client = httpx.Client(base_url=server.url, timeout=60)
        SGLangEngine([server.url]).begin_weight_update()  # an actor that died holding the session
        engine = SGLangEngine([server.url])
        engine.update_weights_from_tensor(builtin_weights(2), 1)  # 400 'already open' -> end, begin, update, end
        r = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": [""], "flush_cache": True})
        assert r.status_code == 400 and "must run between begin_weight_update()" in r.json()["message"]
        r = client.post("/end_weight_update", json={})
        assert r.status_code == 400 and "no weight-update session is open" in r.json()["message"]
        state = _state(client)
        assert [p for p, _ in state["refusals"]] == [
            "/begin_weight_update",
            "/update_weights_from_tensor",
            "/end_weight_update",
        ]
        assert not state["session_open"] and state["weight_version"] == "1" and server.alive()
        engine.offload()
        engine.onload_weights()
        with pytest.raises(httpx.TransportError):  # SGLang's scheduler raises: no answer, the server ends
            client.post("/resume_memory_occupation", json={"tags": ["weights"]})
        deadline = time.monotonic() + 30
        while server.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.poll() is not None
        log = "\n".join(server.log_tail(20))
        assert "KeyError: 'weights'" in log and "SchedulerWeightUpdaterManager" in log
    finally:
        server.stop(timeout=10)


def test_a_release_on_a_busy_server_is_sglangs_assert(own):
    """What SGLang's own manager does with a release while requests run (asked of a scratch copy)."""
    assert _ask(own, "release_while_busy", {}) == {
        "raised": "AssertionError: release_memory_occupation should be called only when server is idle."
    }


def test_lora_adapter_bodies_pass_sglangs_request_structures(own, tmp_path):
    """rollout.sglang.lora_sync=adapter: every body the engine posts (both load routes, unload, the version,
    generate naming the adapter) through SGLang's structures; the tensor payload through its unpickler and
    flattened-bucket reconstruction, tensors equal to the adapter; the launch flags through its parser."""
    from rollflow.flows.config_loading import load_config
    from rollflow.tasks.rollout.sglang.from_config import launch_spec_for

    g = torch.Generator().manual_seed(0)
    tensors = {
        f"base_model.model.model.layers.0.self_attn.q_proj.lora_{p}.weight": torch.randn(s, generator=g)
        for p, s in (("A", (4, 8)), ("B", (8, 4)))
    }
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8.0, "target_modules": ["q_proj"], "use_dora": False}
    posted = []
    for weight_sync in ("tensor", "disk"):
        engine = SGLangEngine(["http://a", "http://b"], tp_sizes=[2, 1], weight_sync=weight_sync, lora_sync="adapter")
        engine.weight_dir = tmp_path / weight_sync

        def record(url, path, body=None, **_):
            posted.append((url, path, body))
            return {"success": True, "loaded_adapters": {}}

        engine._post = record
        engine.update_lora_adapter(tensors, config, 1)
        engine.update_lora_adapter(tensors, config, 2)
    assert {p for _, p, _ in posted} == {
        "/load_lora_adapter_from_tensors",
        "/load_lora_adapter",
        "/unload_lora_adapter",
        "/update_weight_version",
    }
    for url, path, body in posted:
        assert _ask(own, "body_errors", {"route": path, "body": body}) == [], (path, body)
        if path == "/load_lora_adapter_from_tensors":
            assert len(body["serialized_named_tensors"]) == (2 if url == "http://a" else 1)  # one per TP rank
            for data in body["serialized_named_tensors"]:
                out = _ask(own, "payload", {"data": data, "load_format": body["load_format"]})
                assert {t["name"]: t["sha"] for t in out["tensors"]} == {n: tensor_sha(t) for n, t in tensors.items()}
    generate = {"input_ids": [1, 4], "sampling_params": {"max_new_tokens": 2}, "lora_path": "rollflow-v2"}
    assert _ask(own, "body_errors", {"route": "/generate", "body": generate}) == []
    typo = _ask(own, "body_errors", {"route": "/unload_lora_adapter", "body": {"lora_nmae": "x"}})
    assert typo and "lora_name" in typo[0]
    cfg = load_config(None, ["model.lora.rank=4", "rollout.engine=sglang", "rollout.sglang.lora_sync=adapter"])
    args = _ask(own, "server_args", {"argv": launch_command(launch_spec_for("/m", cfg.rollout, port=31000))[3:]})
    targets = args["lora_target_modules"]
    assert args["enable_lora"] is True and args["max_lora_rank"] == 4
    assert sorted(eval(targets) if isinstance(targets, str) else targets) == sorted(cfg.model.lora.target_modules)  # noqa: S307
