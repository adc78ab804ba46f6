"""Contract tests of the `sglang` rollout engine, on CPU, without SGLang.

What speaks SGLang's protocol here is a FAKE server (`tests/fake_sglang_server.py`): a real HTTP
server on 127.0.0.1 that checks every request against the schemas recorded in
`tests/fixtures/sglang_protocol.json` (read from SGLang 0.5.23's source; each entry names its file,
class and the docs page). SGLang's own parser, request structures and unpickler judge the same
command lines, bodies and payloads in tests/test_sglang_own_code.py.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from rollflow.tasks.rollout.engine import GenerationRequest, SamplingParams
from rollflow.tasks.rollout.sglang.engine import EndpointPool, SGLangEngine
from rollflow.tasks.rollout.sglang.flags import (
    FlagSpec,
    UnknownSGLangFlag,
    args_to_argv,
    extract_flags,
    load_flags,
    rewrite_cli_args,
)
from rollflow.tasks.rollout.sglang.hf_checkpoint import write_hf_checkpoint
from rollflow.tasks.rollout.sglang.payloads import (
    SGLangRequestError,
    finish_reason_of,
    generate_payload,
    output_from_response,
    sampling_params_payload,
)
from rollflow.tasks.rollout.sglang.server import (
    INSTALL_HINT,
    EngineDiedError,
    LaunchSpec,
    SGLangNotInstalled,
    SGLangServer,
    free_port,
    launch_command,
)
from rollflow.tasks.sync.weight_group import init_weight_group
from tests.fake_sglang_server import ENDPOINTS, FAKE_START_S, FakeSGLang, check_fields

ROOT = Path(__file__).resolve().parents[1]
FAKE = str(ROOT / "tests" / "fake_sglang_server.py")
BUILTIN = ROOT / "tasks" / "model" / "builtin" / "addition-sft"
HAS_SGLANG = importlib.util.find_spec("sglang") is not None


def fake_launcher(*extra: str) -> list[str]:
    return [sys.executable, FAKE, *extra]


@pytest.fixture
def fake():
    with FakeSGLang(vocab_size=15) as server:
        yield server


def engine_for(*urls, **kw) -> SGLangEngine:
    kw.setdefault("max_inflight", 8)
    return SGLangEngine(list(urls), **kw)


# ------------------------------------------------------------------------------------------------
# Flags: the committed list, validation, the CLI spelling, the static extractor
# ------------------------------------------------------------------------------------------------


def test_flag_list_is_sglang_0_5_23_and_knows_the_flags_we_pass():
    flags = load_flags()
    assert flags.version == "0.5.23"
    assert len(flags.flags) > 500
    expect = {
        "--model-path": "value",
        "--tp-size": "value",
        "--port": "value",
        "--host": "value",
        "--mem-fraction-static": "value",
        "--dtype": "value",
        "--skip-tokenizer-init": "switch",
        "--enable-memory-saver": "switch",
        "--base-gpu-id": "value",
        "--weight-version": "value",
        "--disable-cuda-graph": "switch",
        "--speculative-algorithm": "value",
        "--moe-a2a-backend": "value",
        "--lora-paths": "list",
    }
    for flag, kind in expect.items():
        assert flags.get(flag).kind == kind, flag
    assert flags.get("--disable-cuda-graph").deprecated  # still accepted by 0.5.23, with a warning
    assert flags.get("--model").alias_of == "--model-path"


def test_unknown_flag_names_the_flag_and_the_closest():
    with pytest.raises(UnknownSGLangFlag, match=r"--disable-cuda-grph .*did you mean --disable-cuda-graph"):
        args_to_argv({"disable-cuda-grph": True})


def test_passthrough_args_become_argv():
    argv = args_to_argv(
        {
            "disable-cuda-graph": True,
            "enable-memory-saver": False,
            "speculative_algorithm": "EAGLE",
            "--moe-a2a-backend": "deepep",
            "lora-paths": ["a=/x", "b=/y"],
            "cuda-graph-max-bs-decode": None,
        }
    )
    assert argv == [
        "--disable-cuda-graph",
        "--speculative-algorithm",
        "EAGLE",
        "--moe-a2a-backend",
        "deepep",
        "--lora-paths",
        "a=/x",
        "b=/y",
    ]
    with pytest.raises(ValueError, match="is a switch"):
        args_to_argv({"disable-cuda-graph": "yes"})


def test_cli_spelling_rewrites_to_config_overrides():
    argv = [
        "train",
        "--sglang-disable-cuda-graph",
        "--sglang-speculative-algorithm",
        "EAGLE",
        "--sglang-moe-a2a-backend=deepep",
        "--set",
        "run=x",
    ]
    assert rewrite_cli_args(argv) == [
        "train",
        "--set",
        "rollout.sglang.args.disable-cuda-graph=true",
        "--set",
        "rollout.sglang.args.speculative-algorithm=EAGLE",
        "--set",
        "rollout.sglang.args.moe-a2a-backend=deepep",
        "--set",
        "run=x",
    ]
    with pytest.raises(UnknownSGLangFlag, match="--speculative-algo"):
        rewrite_cli_args(["--sglang-speculative-algo", "EAGLE"])


def test_config_validates_passthrough_and_refuses_managed_flags():
    from rollflow.flows.config_loading import ConfigError, load_config

    cfg = load_config(None, ["rollout.engine=sglang", "rollout.sglang.args.disable_cuda_graph=true"])
    assert cfg.rollout.sglang.args == {"disable-cuda-graph": True}
    with pytest.raises(ConfigError, match="unknown SGLang server flag --mem-fraction"):
        load_config(None, ["rollout.sglang.args.mem-fraction=0.5"])
    with pytest.raises(ConfigError, match="sets --tp-size, which rollflow sets from rollout.sglang.tp_size"):
        load_config(None, ["rollout.sglang.args.tp-size=2"])


SYNTHETIC_FIELDS = """
import argparse
from typing import List, Literal, Optional
import msgspec
from sglang.srt.arg_groups.arg_utils import A, Arg

class Ns(msgspec.Struct):
    _NS_PATH = "ns"
    model_path: A[str, Arg(help="path", aliases=["--model"])]
    tp_size: A[int, "tensor parallel"] = 1
    flag_on: A[bool, "a switch"] = False
    maybe: A[Optional[bool], Arg(help="negatable", action=argparse.BooleanOptionalAction)] = None
    paths: A[Optional[List[str]], "several"] = None
    parsed: A[Optional[List[int]], Arg(help="one json value", type_parser=json.loads)] = None
    choice: A[Literal["a", "b"], "a literal"] = "a"
    hidden: A[bool, Arg(no_cli=True)] = False
    gemm: A[str, Arg(help="renamed", cli_name="--gemm-backend")] = "auto"
    plain_field: int = 0
"""

SYNTHETIC_SERVER_ARGS = """
from sglang.srt.arg_groups.fields.ns import Ns

class ServerArgs:
    @staticmethod
    def add_cli_args(parser):
        parser.add_argument("--config", type=str)
        parser.add_argument("--old-switch", action=DeprecatedStoreTrueAction, new_flag="--flag-on")
        parser.add_argument("--old-valued", action=DeprecatedStoreConstAction, nargs=None, choices=["x"])

_INPUT_NAMESPACES = [Ns]
"""


def test_static_extractor_on_a_synthetic_sglang_tree(tmp_path):
    pkg = tmp_path / "sglang"
    (pkg / "srt" / "arg_groups" / "fields").mkdir(parents=True)
    (pkg / "srt" / "arg_groups" / "fields" / "ns.py").write_text(SYNTHETIC_FIELDS)
    (pkg / "srt" / "server_args.py").write_text(SYNTHETIC_SERVER_ARGS)
    got = {s.flag: s for s in extract_flags(pkg)}
    assert got == {
        "--model-path": FlagSpec("--model-path", "value", "model_path"),
        "--model": FlagSpec("--model", "value", "model_path", alias_of="--model-path"),
        "--tp-size": FlagSpec("--tp-size", "value", "tp_size"),
        "--flag-on": FlagSpec("--flag-on", "switch", "flag_on"),
        "--maybe": FlagSpec("--maybe", "switch", "maybe"),
        "--no-maybe": FlagSpec("--no-maybe", "switch", "maybe", alias_of="--maybe"),
        "--paths": FlagSpec("--paths", "list", "paths"),
        "--parsed": FlagSpec("--parsed", "value", "parsed"),
        "--choice": FlagSpec("--choice", "value", "choice"),
        "--gemm-backend": FlagSpec("--gemm-backend", "value", "gemm"),
        "--config": FlagSpec("--config", "value", "config"),
        "--old-switch": FlagSpec("--old-switch", "switch", "old_switch", deprecated=True),
        "--old-valued": FlagSpec("--old-valued", "value", "old_valued", deprecated=True),
    }


# The committed list against the installed SGLang's own parser: tests/test_sglang_own_code.py (SGLang is
# imported in a process of its own there; its import changes process state).


# ------------------------------------------------------------------------------------------------
# Launch command line and the install hint
# ------------------------------------------------------------------------------------------------


def test_launch_command_for_a_config():
    from rollflow.flows.config_loading import load_config

    cfg = load_config(
        None,
        [
            "rollout.engine=sglang",
            "rollout.dtype=bfloat16",
            "rollout.sglang.mem_fraction_static=0.7",
            "rollout.sglang.args.disable-cuda-graph=true",
            "rollout.sglang.args.speculative-algorithm=EAGLE",
            "rollout.sglang.args.moe-a2a-backend=deepep",
            "resources.num_gpus=4",
            "resources.trainer_gpus=2",
            "resources.num_engines=1",
            "resources.gpus_per_engine=2",
            "rollout.sglang.tp_size=2",
        ],
    )
    sg = cfg.rollout.sglang
    spec = LaunchSpec(
        model_path="/models/qwen",
        port=31000,
        tp_size=sg.tp_size,
        mem_fraction_static=sg.mem_fraction_static,
        dtype=sg.dtype or cfg.rollout.dtype,
        skip_tokenizer_init=sg.skip_tokenizer_init,
        enable_memory_saver=sg.memory_saver,
        base_gpu_id=2,
        weight_version=3,
        args=sg.args,
        python="/venv/bin/python",
    )
    assert launch_command(spec) == [
        "/venv/bin/python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/qwen",
        "--host",
        "127.0.0.1",
        "--port",
        "31000",
        "--tp-size",
        "2",
        "--dtype",
        "bfloat16",
        "--mem-fraction-static",
        "0.7",
        "--base-gpu-id",
        "2",
        "--weight-version",
        "3",
        "--skip-tokenizer-init",
        "--disable-cuda-graph",
        "--speculative-algorithm",
        "EAGLE",
        "--moe-a2a-backend",
        "deepep",
    ]
    flags = load_flags()
    for arg in launch_command(spec):  # every flag we generate is one SGLang 0.5.23 has
        if arg.startswith("--"):
            assert flags.get(arg) is not None, arg
    wrapped = LaunchSpec(
        model_path="m",
        port=1,
        launcher=["nsys", "profile", "{python}", "-m", "sglang.launch_server"],
        python="/p",
        skip_tokenizer_init=False,
    )
    assert launch_command(wrapped)[:5] == ["nsys", "profile", "/p", "-m", "sglang.launch_server"]


def test_missing_sglang_is_a_clear_error_at_use_time_only(tmp_path, monkeypatch):
    import rollflow.tasks.rollout.sglang.server as sglang_server
    from rollflow.tasks.rollout.settings import RolloutConfig
    from rollflow.tasks.rollout.worker import build_engine

    if HAS_SGLANG:  # the test setup installs SGLang's pure-Python wheel: make it look absent here
        real = importlib.util.find_spec
        monkeypatch.setattr(
            sglang_server.importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a)
        )
    assert "pip install 'rollflow[sglang]'" in INSTALL_HINT
    with pytest.raises(
        SGLangNotInstalled,
        match=r"rollout.engine='sglang' needs SGLang on a GPU machine: "
        r"pip install 'rollflow\[sglang\]'",
    ):
        build_engine("builtin:addition", RolloutConfig(engine="sglang"))


# ------------------------------------------------------------------------------------------------
# Payloads against the recorded schemas; status mapping
# ------------------------------------------------------------------------------------------------


def test_generate_payload_conforms_to_recorded_schema():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=8, stop_token_ids=(2, 5))
    payload = generate_payload([1, 4, 5], sampling_params_payload(params, n=4, seed=11), rid="r-0")
    assert payload == {
        "input_ids": [1, 4, 5],
        "rid": "r-0",
        "return_logprob": True,
        "sampling_params": {
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": -1,
            "max_new_tokens": 8,
            "stop_token_ids": [2, 5],
            "n": 4,
            "sampling_seed": 11,
        },
    }
    assert check_fields(payload, ENDPOINTS["/generate"], "/generate") == []
    assert check_fields(payload["sampling_params"], ENDPOINTS["sampling_params"], "sampling_params") == []
    assert sampling_params_payload(SamplingParams(top_k=20))["top_k"] == 20
    # the recorded schema rejects what SGLang rejects: unknown sampling keys
    assert check_fields({"seed": 1}, ENDPOINTS["sampling_params"], "sp") == ["sp: unknown field 'seed'"]
    # SGLang's own /generate contract decoder judges the bodies in tests/test_sglang_own_code.py


def test_recorded_examples_conform_and_name_their_sources():
    for path, spec in ENDPOINTS.items():
        assert spec["source"], path
        if "example_request" in spec:
            assert check_fields(spec["example_request"], spec, path) == [], path


@pytest.mark.parametrize("kind,expected", [("stop", "stop"), ("length", "length"), ("abort", "abort")])
def test_finish_reason_mapping(kind, expected):
    from rollflow.artifacts.sample import Status
    from rollflow.tasks.rollout.generate import FINISH_TO_STATUS

    recorded = ENDPOINTS["/generate"]["finish_reasons"][kind]
    assert finish_reason_of({"finish_reason": recorded}) == expected
    assert (
        FINISH_TO_STATUS[expected]
        == {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}[kind]
    )


def test_response_parsing_of_the_recorded_example():
    out = output_from_response(ENDPOINTS["/generate"]["example_response"])
    assert out.response_ids == [9, 4, 2] and out.log_probs == [-0.51, -1.2, -0.05] and out.finish_reason == "stop"
    with pytest.raises(SGLangRequestError, match="unknown SGLang finish_reason"):
        finish_reason_of({"finish_reason": {"type": "weird"}})
    with pytest.raises(SGLangRequestError, match="return_logprob"):
        output_from_response({"output_ids": [1], "meta_info": {"finish_reason": {"type": "length"}}})


# ------------------------------------------------------------------------------------------------
# Generation over the fake server: statuses, n, abort, load balancing
# ------------------------------------------------------------------------------------------------


def test_generate_and_statuses_through_generate_samples(fake):
    from rollflow.artifacts.sample import Status
    from rollflow.tasks.model.tokenizer import load_tokenizer
    from rollflow.tasks.rollout.addition import addition_prompts
    from rollflow.tasks.rollout.generate import generate_samples

    engine = engine_for(fake.url)
    tok = load_tokenizer(BUILTIN)
    items = addition_prompts(6, seed=0, digits=3)
    samples = generate_samples(engine, tok, items, SamplingParams(max_new_tokens=5), 3)
    assert len(samples) == 18 and [s.group_index for s in samples] == [g for g in range(6) for _ in range(3)]
    assert {s.status for s in samples} <= {Status.COMPLETED, Status.TRUNCATED}
    assert all(len(s.rollout_log_probs) == s.response_length for s in samples)
    for s in samples:
        assert s.status == (Status.COMPLETED if s.tokens[-1] == 2 else Status.TRUNCATED)
    gen_calls = fake.calls("/generate")
    assert len(gen_calls) == 18  # n_mode=repeat: one request per sample, each with its own rid
    assert len({c[2]["rid"] for c in gen_calls}) == 18
    assert all(c[2]["return_logprob"] is True and "n" not in c[2]["sampling_params"] for c in gen_calls)


def test_native_n_is_one_request_per_prompt(fake):
    engine = engine_for(fake.url, n_mode="native")
    out = engine.generate(
        [GenerationRequest([1, 4, 5], n=3), GenerationRequest([1, 6], n=1)], SamplingParams(max_new_tokens=4)
    )
    assert [len(o) for o in out] == [3, 1]
    calls = fake.calls("/generate")
    assert sorted(c[2]["sampling_params"].get("n", 1) for c in calls) == [1, 3]


def test_schema_violation_is_an_error_with_the_servers_text(fake):
    import httpx

    r = httpx.post(f"{fake.url}/generate", json={"input_ids": [1], "sampling_params": {"seed": 3}})
    assert r.status_code == 400 and "unknown field 'seed'" in r.text


def test_abort_all_inflight(fake):
    fake.step_delay_s = 0.02
    engine = engine_for(fake.url, max_inflight=4)
    result = {}
    t = threading.Thread(
        target=lambda: result.update(
            out=engine.generate(
                [GenerationRequest([1, 4], n=4), GenerationRequest([1, 5], n=4)], SamplingParams(max_new_tokens=200)
            )
        )
    )
    t.start()
    deadline = time.monotonic() + 10
    while not fake.inflight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.abort() == 1
    t.join(10)
    outs = [o for group in result["out"] for o in group]
    assert len(outs) == 8 and all(o.finish_reason == "abort" for o in outs)
    assert ("POST", "/abort_request", {"abort_all": True}) in fake.calls("/abort_request")
    assert len(fake.calls("/generate")) <= 4  # queued samples were never sent


def test_abort_one_request_by_rid(fake):
    fake.step_delay_s = 0.02
    engine = engine_for(fake.url, max_inflight=2)
    result = {}
    t = threading.Thread(
        target=lambda: result.update(
            out=engine.generate(
                [GenerationRequest([1, 4], n=1), GenerationRequest([1, 5], n=1)], SamplingParams(max_new_tokens=40)
            )
        )
    )
    t.start()
    deadline = time.monotonic() + 10
    while len(engine.inflight()) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    victim = engine.inflight()[0]
    assert engine.abort([victim]) == 1
    t.join(10)
    reasons = [g[0].finish_reason for g in result["out"]]
    victim_index = int(victim.split("-")[-2])  # rids are <prefix>-<request>-<sample>
    assert reasons[victim_index] == "abort" and reasons[1 - victim_index] in ("length", "stop")
    assert fake.calls("/abort_request")[-1][2] == {"rid": victim, "abort_all": False}


def test_load_balancing_policies():
    rr = EndpointPool(["a", "b", "c"], "round_robin")
    assert [rr.acquire() for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]
    lo = EndpointPool(["a", "b"], "least_outstanding")
    assert [lo.acquire(), lo.acquire(), lo.acquire()] == ["a", "b", "a"]
    lo.release("a"), lo.release("a")
    assert lo.acquire() == "a" and lo.outstanding == {"a": 1, "b": 1}
    with pytest.raises(ValueError, match="load_balance"):
        EndpointPool(["a"], "random")


def test_requests_spread_over_servers():
    with FakeSGLang() as a, FakeSGLang() as b:
        engine = engine_for(a.url, b.url, load_balance="round_robin", max_inflight=1)
        engine.generate(
            [GenerationRequest([1, 4], n=4), GenerationRequest([1, 5], n=2)], SamplingParams(max_new_tokens=3)
        )
        assert len(a.calls("/generate")) == 3 and len(b.calls("/generate")) == 3
        a.step_delay_s = 0.05  # a slow server gets fewer requests under least_outstanding
        engine = engine_for(a.url, b.url, load_balance="least_outstanding", max_inflight=4)
        engine.generate([GenerationRequest([1, 4], n=16)], SamplingParams(max_new_tokens=4))
        assert engine.pool.sent[b.url] > engine.pool.sent[a.url]


# ------------------------------------------------------------------------------------------------
# Weight updates: the three paths, memory, flush, bookkeeping
# ------------------------------------------------------------------------------------------------


def tiny_weights():
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(15, 8, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, generator=g),
        "lm_head.weight": torch.randn(15, 8, generator=g),
    }


def builtin_weights(n: int) -> dict[str, torch.Tensor]:
    """The first `n` tensors of the built-in model (the fake refuses names and shapes its model lacks)."""
    from safetensors.torch import load_file

    named = load_file(str(BUILTIN / "model.safetensors"))
    return {k: named[k] for k in sorted(named)[:n]}


def test_write_hf_checkpoint_single_and_sharded(tmp_path):
    from safetensors.torch import load_file

    w = tiny_weights()
    one = write_hf_checkpoint(w, tmp_path / "one", config_dir=BUILTIN)
    assert sorted(p.name for p in one.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "rollflow_char_tokenizer.json",
    ]
    back = load_file(str(one / "model.safetensors"))
    assert all(torch.equal(back[k], w[k]) for k in w)
    sharded = write_hf_checkpoint(w, tmp_path / "sharded", config={"model_type": "qwen2"}, max_shard_bytes=600)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(w) and len(set(index["weight_map"].values())) == 3
    assert not list(tmp_path.glob(".*tmp*"))  # the temp dir was renamed into place


def test_update_from_disk_call_sequence(fake, tmp_path):
    engine = engine_for(fake.url, weight_sync="disk", weight_dir=tmp_path / "w", config_dir=BUILTIN)
    engine.update_weights(tiny_weights(), 1)
    engine.update_weights(tiny_weights(), 2)
    calls = fake.calls("/update_weights_from_disk")
    assert [c[2] for c in calls] == [
        {
            "model_path": str(tmp_path / "w" / "v000001"),
            "weight_version": "1",
            "flush_cache": True,
            "abort_all_requests": False,
        },
        {
            "model_path": str(tmp_path / "w" / "v000002"),
            "weight_version": "2",
            "flush_cache": True,
            "abort_all_requests": False,
        },
    ]
    assert fake.disk_updates[0]["files"] == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "rollflow_char_tokenizer.json",
    ]
    assert engine.weight_version == 2 and engine.model_info()["weight_version"] == "2"
    with pytest.raises(ValueError, match="does not follow"):
        engine.update_weights(tiny_weights(), 5)  # a skipped version is refused before any request
    assert len(fake.calls("/update_weights_from_disk")) == 2


def test_update_from_tensor_call_sequence():
    with FakeSGLang(tp_size=2) as fake:
        engine = engine_for(fake.url, tp_sizes=2, weight_sync="tensor", bucket_bytes=600)
        w = tiny_weights()
        engine.update_weights(w, 1)
        calls = fake.calls("/update_weights_from_tensor")
        assert len(calls) == 3  # one bucket per tensor at 600 bytes
        assert [c[2]["flush_cache"] for c in calls] == [False, False, True]
        assert [c[2].get("weight_version") for c in calls] == [None, None, "1"]
        assert all(len(c[2]["serialized_named_tensors"]) == 2 for c in calls)  # one payload per TP rank
        from tests.fake_sglang_server import _sha

        got = [entry for update in fake.tensor_updates for entry in update[0]]
        assert got == [(k, tuple(v.shape), _sha(v)) for k, v in w.items()]
        assert fake.tensor_updates[0][0] == fake.tensor_updates[0][1]
        assert engine.weight_version == 1 and fake.weight_version == "1"


def test_colocated_offload_cycle(fake):
    engine = engine_for(fake.url, weight_sync="tensor")
    engine.offload()
    with pytest.raises(SGLangRequestError, match="memory released"):
        engine.generate([GenerationRequest([1, 4])], SamplingParams(max_new_tokens=2))
    engine.onload_weights()
    engine.update_weights(tiny_weights(), 1)
    engine.onload_kv_cache()
    engine.generate([GenerationRequest([1, 4])], SamplingParams(max_new_tokens=2))
    engine.flush_cache()
    seq = [(p, b) for _, p, b in fake.calls() if p != "/generate"]
    assert seq == [
        ("/flush_cache", None),  # idle before the release (SGLang asserts it)
        ("/release_memory_occupation", {"tags": ["kv_cache", "weights", "cuda_graph"]}),
        ("/abort_request", {"abort_all": True}),  # the failed generate aborts whatever else was in flight
        ("/resume_memory_occupation", {"tags": ["weights"]}),
        ("/begin_weight_update", {}),
        ("/update_weights_from_tensor", seq[5][1]),
        ("/end_weight_update", {}),
        ("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}),
        ("/flush_cache", {}),
    ]
    assert seq[5][1]["load_format"] == "flattened_bucket" and not fake.refusals
    with pytest.raises(ValueError, match="unknown memory tags"):
        engine.release_memory(["activations"])


def test_info_and_health_endpoints(fake):
    engine = engine_for(fake.url)
    assert engine.health() == {fake.url: True} and engine.health_generate() == {fake.url: True}
    assert engine.model_info()["model_path"] == "fake-model"
    assert engine.server_info()["version"] == "0.5.23"
    assert engine.alive()
    assert engine.describe() == {"backend": "sglang", "model": "model", "weight_version": "0"}
    with pytest.raises(NotImplementedError, match="get_weights_by_name"):
        engine.named_weights()


def test_update_from_distributed_gloo_end_to_end(tmp_path):
    """The NCCL path's call sequence for real, with gloo on CPU: the fake server process joins the
    group as rank 1 (as SGLang's engine does) and receives the tensors the trainer broadcasts."""
    import torch.distributed as dist

    from rollflow.tasks.sync.weight_group import broadcaster

    spec = LaunchSpec(model_path=str(BUILTIN), port=free_port(), launcher=fake_launcher(), skip_tokenizer_init=False)
    with SGLangServer(spec, log_path=tmp_path / "fake.log").start() as server:
        server.wait_healthy(timeout=FAKE_START_S)
        engine = SGLangEngine([server.url], servers=[server], bucket_bytes=600)
        port = free_port()
        group: list = []
        w = builtin_weights(3)  # names and shapes the served model has (others are refused)
        buckets = engine.sync_weights_distributed(
            w,
            1,
            broadcast=lambda t: broadcaster(group[0])(t),
            join_group=lambda: group.append(
                init_weight_group(
                    "127.0.0.1",
                    port,
                    rank=0,
                    world_size=engine.weight_group_world_size,
                    group_name="g",
                    backend="gloo",
                    timeout_s=60,
                )
            ),
            master_port=port,
            group_name="g",
            backend="gloo",
            timeout_s=60,
        )
        engine.destroy_weights_update_group("g")
        dist.destroy_process_group(group[0])
        state = engine.client.get(f"{server.url}/_fake/state").json()
    from tests.fake_sglang_server import _sha

    assert buckets == 3
    assert [(r[0], tuple(r[1])) for r in state["received"]] == [(k, tuple(v.shape)) for k, v in w.items()]
    assert [r[2] for r in state["received"]] == [_sha(v) for v in w.values()]  # the broadcast data arrived
    calls = [(p, b) for _, p, b in state["calls"] if p != "/health"]
    assert calls[0] == (
        "/init_weights_update_group",
        {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "g",
            "backend": "gloo",
        },
    )
    dist_calls = [b for p, b in calls if p == "/update_weights_from_distributed"]
    assert [b["names"] for b in dist_calls] == [[k] for k in w]
    first = next(iter(w))
    assert dist_calls[0] == {
        "names": [first],
        "dtypes": ["float32"],
        "shapes": [list(w[first].shape)],
        "group_name": "g",
        "flush_cache": False,
    }
    assert [p for p, _ in calls if "weight_update" in p] == ["/begin_weight_update", "/end_weight_update"]
    assert dist_calls[-1]["weight_version"] == "1" and dist_calls[-1]["flush_cache"] is True
    assert calls[-1] == ("/destroy_weights_update_group", {"group_name": "g"})
    assert engine.weight_version == 1


def test_distributed_group_ranks_for_several_engines():
    with FakeSGLang(tp_size=2) as a, FakeSGLang(tp_size=4) as b:
        engine = SGLangEngine([a.url, b.url], tp_sizes=[2, 4])
        for fut in engine.init_weights_update_group("10.0.0.1", 29600, backend="nccl"):
            fut.result(10)
        assert a.calls()[-1][2]["rank_offset"] == 1 and b.calls()[-1][2]["rank_offset"] == 3
        assert a.calls()[-1][2]["world_size"] == b.calls()[-1][2]["world_size"] == 7


# ------------------------------------------------------------------------------------------------
# Process management and crashes
# ------------------------------------------------------------------------------------------------


def test_server_dying_mid_rollout_is_reported_with_its_log_then_a_new_one_completes(tmp_path):
    spec = LaunchSpec(model_path=str(BUILTIN), port=free_port(), launcher=fake_launcher("--die-after", "1"))
    assert launch_command(spec)[:2] == [sys.executable, FAKE]
    server = SGLangServer(spec, log_path=tmp_path / "dying.log", tail_lines=5).start()
    server.wait_healthy(timeout=FAKE_START_S)
    engine = SGLangEngine([server.url], servers=[server], max_inflight=1)
    requests = [GenerationRequest([1, 4, 5], n=1) for _ in range(3)]
    with pytest.raises(EngineDiedError) as err:
        engine.generate(requests, SamplingParams(max_new_tokens=3))
    msg = str(err.value)
    assert "died during /generate" in msg and "exit code 17" in msg
    assert "fake-sglang: exiting mid-request on /generate #2 (--die-after 1)" in msg
    assert err.value.returncode == 17 and len(err.value.log_tail) <= 5
    assert not engine.alive()
    server.stop()
    # the restart: a fresh server on a fresh port serves the same rollout to the end
    spec2 = LaunchSpec(model_path=str(BUILTIN), port=free_port(), launcher=fake_launcher())
    with SGLangServer(spec2, log_path=tmp_path / "fresh.log").start() as fresh:
        fresh.wait_healthy(timeout=FAKE_START_S)
        out = SGLangEngine([fresh.url], servers=[fresh]).generate(requests, SamplingParams(max_new_tokens=3))
        assert [len(o) for o in out] == [1, 1, 1]


def test_startup_death_fails_fast_with_the_log(tmp_path):
    spec = LaunchSpec(
        model_path="m",
        port=free_port(),
        launcher=[sys.executable, "-c", "import sys; print('CUDA error: no kernel image'); sys.exit(3)"],
    )
    server = SGLangServer(spec, log_path=tmp_path / "s.log").start()
    t0 = time.monotonic()
    with pytest.raises(EngineDiedError, match=r"died during startup \(exit code 3\)(.|\n)*no kernel image"):
        server.wait_healthy(timeout=60)
    assert time.monotonic() - t0 < 10


def test_stop_escalates_to_sigkill(tmp_path):
    spec = LaunchSpec(
        model_path="m",
        port=free_port(),
        launcher=[
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ignor' + 'ing', flush=True); "
            "time.sleep(60)",
        ],
    )
    server = SGLangServer(spec, log_path=tmp_path / "s.log").start()
    deadline = time.monotonic() + 10
    while "ignoring" not in server.log_tail()[1:] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.stop(timeout=0.5) == -9


def test_stop_is_clean_with_sigterm(tmp_path):
    spec = LaunchSpec(model_path=str(BUILTIN), port=free_port(), launcher=fake_launcher())
    server = SGLangServer(spec, log_path=tmp_path / "s.log").start()
    server.wait_healthy(timeout=FAKE_START_S)
    assert server.stop(timeout=10) == 0
    assert "fake-sglang: SIGTERM, exiting" in "\n".join(server.log_tail())


@pytest.mark.slow
def test_prefect_retry_restarts_the_engine_actor_after_its_server_died(tmp_path, prefect_api, ray_local):
    """Through the real machinery: Prefect `generate` task -> Ray engine actor -> SGLang-protocol server
    process (the fake, which exits on its 2nd /generate once). The task fails with the server's log
    tail, its retry finds the actor unhealthy (`ping`), `ensure_engine` restarts it with a new server,
    and the rollout completes."""
    from prefect import flow

    from rollflow.flows.group import WorkerGroup
    from rollflow.flows.iteration import generate_task
    from tests.conftest import small_config

    marker = tmp_path / "died-once"
    cfg = small_config(
        tmp_path,
        run="sglang-crash",
        data={"prompts_per_rollout": 4},
        rollout={
            "engine": "sglang",
            "n_samples_per_prompt": 2,
            "sglang": {
                "launcher": fake_launcher("--die-after", "1", "--die-once-marker", str(marker)),
                "max_inflight": 1,
                "startup_timeout_s": 60,
            },
        },
        train={"num_steps_per_rollout": 1},
    )

    @flow(name="sglang-crash-retry")
    def rollout_once():
        return generate_task(cfg, 0)

    try:
        samples = rollout_once()
        assert marker.exists()  # the first server really died mid-rollout
        assert len(samples) == 8 and {s.group_index for s in samples} == {0, 1, 2, 3}
        engine = WorkerGroup.for_run(cfg).engine()
        assert engine.alive() and engine.describe().backend == "sglang"
    finally:
        WorkerGroup.for_run(cfg).stop_all()
