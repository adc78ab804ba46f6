"""Whole-tensor weight checks over SGLang's /weights_checker (tasks/rollout/sglang/weights_check.py),
against the FAKE SGLang server (tests/fake_sglang_server.py), which holds real CPU weights and
implements WeightChecker's snapshot / reset_tensors / compare / checksum over them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollflow.tasks.rollout.sglang.engine import SGLangEngine
from rollflow.tasks.rollout.sglang.payloads import SGLangRequestError
from rollflow.tasks.rollout.sglang.weights_check import (
    Mismatch,
    WeightsCheckerMissing,
    WeightsCheckError,
    check_weights,
    checksums_of,
    compare_engines,
    engine_checksums,
    finish_overwrite_check,
    parse_mismatches,
    verify_update_overwrites_all,
)
from tests.fake_sglang_server import ENDPOINTS, FAKE_START_S, FakeSGLang, check_fields

ROOT = Path(__file__).resolve().parents[1]
BUILTIN = ROOT / "tasks" / "model" / "builtin" / "addition-sft"
FAKE = str(ROOT / "tests" / "fake_sglang_server.py")
DROPPED = "model.layers.1.mlp.down_proj.weight"  # not fused: SGLang reports it under the same name


def engine_names(names) -> set[str]:
    """SGLang's parameter names for HF names: q/k/v fused into qkv_proj, gate/up into gate_up_proj, and no
    lm_head in a tied model (the built-in one is tied)."""
    fused = {
        "q_proj": "qkv_proj",
        "k_proj": "qkv_proj",
        "v_proj": "qkv_proj",
        "gate_proj": "gate_up_proj",
        "up_proj": "gate_up_proj",
    }
    out = set()
    for name in names:
        for hf, engine in fused.items():
            name = name.replace(f".{hf}.", f".{engine}.")
        out.add(name)
    return out - {"lm_head.weight"}


def checkpoint() -> dict[str, torch.Tensor]:
    return load_file(str(BUILTIN / "model.safetensors"))


def tensor_engine(*urls, **kw) -> SGLangEngine:
    return SGLangEngine(list(urls), weight_sync="tensor", max_inflight=4, **kw)


# ------------------------------------------------------------------------------------------------
# snapshot -> reset_tensors -> push -> compare
# ------------------------------------------------------------------------------------------------


def test_full_check_passes_when_the_push_sends_the_checkpoint():
    w = checkpoint()
    with FakeSGLang(model_path=str(BUILTIN)) as fake:
        assert set(fake.weights) == set(w) and len(w) == 26  # loaded at startup
        engine = tensor_engine(fake.url)
        result = verify_update_overwrites_all(engine, lambda: engine.update_weights_from_tensor(w, 1))
        assert result.ok, result.summary()
        assert result.mismatched == [] and result.servers[0].message == "Success."
        assert result.to_dict()["ok"] is True and "ok on 1 server" in result.summary()
        assert all(torch.equal(fake.weights[k], w[k]) for k in w)  # the push restored every tensor
        assert [c[2]["action"] for c in fake.calls("/weights_checker")] == ["snapshot", "reset_tensors", "compare"]
        assert engine.weight_version == 1
        # a passing compare consumes the snapshot (SGLang 0.5.23): a second compare is a bare assert
        again = finish_overwrite_check(engine)
        assert not again.ok and again.servers[0].message == "" and "no snapshot" in again.summary()


def test_check_fails_naming_exactly_the_tensor_the_engine_did_not_update():
    w = checkpoint()
    with FakeSGLang(model_path=str(BUILTIN), ignore_update_of=DROPPED) as fake:
        engine = tensor_engine(fake.url)
        result = verify_update_overwrites_all(engine, lambda: engine.update_weights_from_tensor(w, 1))
        assert not result.ok
        assert result.mismatched == [DROPPED]
        (verdict,) = result.servers
        assert verdict.url == fake.url and verdict.names == [DROPPED]
        assert verdict.mismatches[0].max_abs_err > 0 and verdict.mismatches[0].num_exceed > 0
        assert verdict.message.startswith("check tensor equality failed:\nname=" + DROPPED)
        assert DROPPED in result.summary() and fake.url in result.summary() and "random values" in result.summary()
        assert not torch.equal(fake.weights[DROPPED], w[DROPPED])  # still the reset's random values


def test_check_fails_on_a_one_ulp_difference():
    w = checkpoint()
    name = "model.layers.0.self_attn.q_proj.bias"
    pushed = dict(w)
    bumped = w[name].clone()
    bumped[7] = torch.nextafter(bumped[7], torch.tensor(float("inf")))
    pushed[name] = bumped
    ulp = (bumped[7] - w[name][7]).abs().item()
    assert 0 < ulp < 1e-6
    with FakeSGLang(model_path=str(BUILTIN)) as fake:
        engine = tensor_engine(fake.url)
        result = verify_update_overwrites_all(engine, lambda: engine.update_weights_from_tensor(pushed, 1))
    assert result.mismatched == ["model.layers.0.self_attn.qkv_proj.bias"]  # SGLang's fused name
    (mismatch,) = result.servers[0].mismatches
    assert mismatch.num_exceed == 1 and mismatch.max_abs_err == pytest.approx(ulp, rel=1e-6)


def test_disk_path_and_a_push_that_fails(tmp_path):
    w = checkpoint()
    with FakeSGLang(model_path=str(BUILTIN), ignore_update_of=[DROPPED]) as fake:
        engine = SGLangEngine([fake.url], weight_sync="disk", weight_dir=tmp_path / "w", config_dir=BUILTIN)
        result = verify_update_overwrites_all(engine, lambda: engine.update_weights(w, 1))
        assert result.mismatched == [DROPPED]

        def broken_push():
            raise ConnectionError("trainer went away")

        with pytest.raises(ConnectionError) as err:
            verify_update_overwrites_all(engine, broken_push)
        assert any("randomised" in note for note in err.value.__notes__)


# ------------------------------------------------------------------------------------------------
# Schema conformance, errors
# ------------------------------------------------------------------------------------------------


def test_requests_conform_to_the_recorded_schema_and_extra_fields_are_refused():
    spec = ENDPOINTS["/weights_checker"]
    assert spec["required"] == ["action"] and spec["fields"]["action"] == "str"
    with FakeSGLang(model_path=str(BUILTIN)) as fake:
        engine = tensor_engine(fake.url)
        verify_update_overwrites_all(
            engine,
            lambda: engine.update_weights_from_tensor(checkpoint(), 1),
            skip_tensor_list=["norm"],
            allow_quant_error=False,
        )
        engine_checksums(engine)
        sent = [c[2] for c in fake.calls("/weights_checker")]
        assert sent == [
            {"action": "snapshot", "skip_tensor_list": ["norm"]},
            {"action": "reset_tensors", "skip_tensor_list": ["norm"]},
            {"action": "compare", "skip_tensor_list": ["norm"], "allow_quant_error": False},
            {"action": "checksum"},
        ]
        assert all(check_fields(p, spec, "/weights_checker") == [] for p in sent)
        # what the fake refuses, as recorded: an unknown field, a missing action, a wrong type
        for bad, problem in (
            ({"action": "compare", "snapshot_id": 1}, "unknown field 'snapshot_id'"),
            ({}, "missing required field 'action'"),
            ({"action": 3}, "is not str"),
        ):
            r = engine.client.post(f"{fake.url}/weights_checker", json=bad)
            assert r.status_code == 400 and problem in r.json()["error"], bad
        # SGLang's own refusals: an unknown action
        r = engine.client.post(f"{fake.url}/weights_checker", json={"action": "restore"})
        assert (
            r.status_code == 400
            and r.json() == ENDPOINTS["/weights_checker"]["example_responses"]["unsupported_action"]["body"]
        )
        with pytest.raises(ValueError, match="unknown /weights_checker action 'restore'"):
            check_weights(engine, "restore")
        # the recorded failed-compare example parses
        example = ENDPOINTS["/weights_checker"]["example_responses"]["compare_failed"]["body"]["message"]
        assert [m.name for m in parse_mismatches(example)] == [
            "model.layers.0.self_attn.qkv_proj.weight",
            "model.norm.weight",
        ]


def test_a_server_without_the_endpoint_is_a_clear_error():
    with FakeSGLang(model_path=str(BUILTIN), disable_endpoints=["/weights_checker"]) as fake:
        engine = tensor_engine(fake.url)
        with pytest.raises(WeightsCheckerMissing) as err:
            verify_update_overwrites_all(engine, lambda: pytest.fail("push must not run"))
        msg = str(err.value)
        assert f"{fake.url}/weights_checker" in msg and "action=snapshot" in msg and "404" in msg
        assert "no /weights_checker" in msg and "upgrade SGLang" in msg and "Not Found" in msg
        assert isinstance(err.value, SGLangRequestError)
        with pytest.raises(WeightsCheckerMissing):
            engine_checksums(engine)


def test_snapshot_failure_and_a_body_that_is_no_result_raise():
    with FakeSGLang(model_path=str(BUILTIN)) as fake:
        engine = tensor_engine(fake.url)

        def failing(payload):
            return 400, {"success": False, "message": "CUDA out of memory (pinned CPU)"}

        fake.ep_weights_checker = failing
        with pytest.raises(WeightsCheckError, match=r"action=snapshot failed: 'CUDA out of memory"):
            verify_update_overwrites_all(engine, lambda: None)
        fake.ep_weights_checker = lambda payload: (500, "Internal Server Error")
        with pytest.raises(SGLangRequestError, match="answered 500"):
            check_weights(engine, "checksum")


def test_parse_mismatches_merges_ranks_and_keeps_the_largest_error():
    message = (
        "check tensor equality failed:\nname=a.weight max_abs_err=0.5 mean_abs_err=0.1 num_exceed=3 "
        "expect=raw(shape=(2,) dtype=torch.float32) actual=raw(shape=(2,) dtype=torch.float32) \n"
        "name=b max_abs_err=nan mean_abs_err=nan num_exceed=-1 expect=missing actual=raw(shape=(1,)) "
        " | check tensor equality failed:\nname=a.weight max_abs_err=0.75 mean_abs_err=0.2 num_exceed=4 "
    )
    got = parse_mismatches(message)
    assert [m.name for m in got] == ["a.weight", "b"]
    assert got[0] == Mismatch("a.weight", 0.75, 0.2, 4)
    assert got[1].num_exceed == -1 and got[1].max_abs_err != got[1].max_abs_err  # nan
    assert parse_mismatches("") == []


# ------------------------------------------------------------------------------------------------
# Checksums: every server holds the same tensors
# ------------------------------------------------------------------------------------------------


def test_compare_engines_names_the_tensor_and_the_server_that_missed_an_update():
    w = checkpoint()
    new = {k: v + 1.0 for k, v in w.items()}
    with (
        FakeSGLang(model_path=str(BUILTIN), tp_size=2) as a,
        FakeSGLang(model_path=str(BUILTIN), tp_size=2, ignore_update_of=DROPPED) as b,
    ):
        engine = tensor_engine(a.url, b.url, tp_sizes=2)
        before = engine_checksums(engine)
        assert set(before) == {a.url, b.url} and set(before[a.url]) == engine_names(w)
        assert compare_engines(before).ok
        engine.update_weights_from_tensor(new, 1)
        after = engine_checksums(engine)
        report = compare_engines(after)
        assert not report.ok
        assert report.differing == {DROPPED: [b.url]} and report.missing == {}
        assert report.by_url == {b.url: [DROPPED]}
        assert DROPPED in report.summary() and b.url in report.summary()
        assert report.to_dict()["differing"] == {DROPPED: [b.url]}
        # every other tensor changed on both servers and agrees
        assert all(after[a.url][n] != before[a.url][n] for n in engine_names(w))
        # TP shards: each rank hashes its own shard; a name's value combines them in rank order
        body = check_weights(engine, "checksum")[0]
        assert [r["parallelism_info"][0]["tp_rank"] for r in body["ranks"]] == [0, 1]
        assert body["ranks"][0]["checksums"][DROPPED] != body["ranks"][1]["checksums"][DROPPED]
        assert checksums_of({"ranks": body["ranks"][::-1]}) == checksums_of(body) == after[a.url]


def test_compare_engines_majority_and_missing_names():
    sums = {"u1": {"x": "1", "y": "7"}, "u2": {"x": "2", "y": "7"}, "u3": {"x": "2"}}
    report = compare_engines(sums)
    assert report.differing == {"x": ["u1"]} and report.missing == {"y": ["u3"]}
    assert report.by_url == {"u1": ["x"], "u3": ["y"]} and report.n_tensors == 2
    assert compare_engines({"u1": {"x": "1"}}).ok
    # the list shape a newer SGLang may answer ("payload", one dict per rank, or a list of results)
    info = {"checksums": {"x": "ab"}, "per_gpu_checksum": "z", "parallelism_info": {"tp_rank": 0}}
    assert checksums_of({"success": True, "payload": [info]}) == checksums_of({"payload": info}) == {"x": "ab"}


# ------------------------------------------------------------------------------------------------
# The fake's weights through the other endpoints
# ------------------------------------------------------------------------------------------------


def test_get_weights_by_name_serves_the_held_weights_as_sglang_does(tmp_path):
    """SGLang 0.5.23 implements get_weights_by_name per model class: Llama has it, Qwen2 answers 400."""
    import json
    import shutil

    from rollflow.tasks.sync.parity import tensor_prefix

    w = checkpoint()
    name = "model.layers.0.mlp.down_proj.weight"  # (128, 512)
    with FakeSGLang(model_path=str(BUILTIN)) as qwen2:
        with pytest.raises(SGLangRequestError, match="Get parameter by name failed"):
            tensor_engine(qwen2.url).get_weights_by_name(name)
    llama = tmp_path / "llama"
    shutil.copytree(BUILTIN, llama)
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    with FakeSGLang(model_path=str(llama)) as fake:
        engine = tensor_engine(fake.url)
        rows = engine.get_weights_by_name(name, truncate_size=2)
        assert len(rows) == 2 and len(rows[0]) == 512  # SGLang: .tolist()[:truncate_size], rows of a 2-D tensor
        flat = [x for row in rows for x in row]  # what tasks/rollout/worker.py:_flatten does
        assert flat[:64] == tensor_prefix(w[name], 64)
        norm = "model.norm.weight"
        assert engine.get_weights_by_name(norm, truncate_size=3) == tensor_prefix(w[norm], 3)
        with pytest.raises(SGLangRequestError, match="Get parameter by name failed"):
            engine.get_weights_by_name("lm_head.weight")
        assert all(
            check_fields(c[2], ENDPOINTS["/get_weights_by_name"], "/get_weights_by_name") == []
            for c in fake.calls("/get_weights_by_name")
        )


def test_distributed_path_in_a_launched_fake_with_ignore_flag(tmp_path):
    """Process mode: `--ignore-update-of` on the command line, the weights arriving over gloo."""
    import torch.distributed as dist

    from rollflow.tasks.rollout.sglang.server import LaunchSpec, SGLangServer, free_port
    from rollflow.tasks.sync.weight_group import broadcaster, init_weight_group

    w = checkpoint()
    spec = LaunchSpec(
        model_path=str(BUILTIN), port=free_port(), launcher=[sys.executable, FAKE, "--ignore-update-of", DROPPED]
    )
    with SGLangServer(spec, log_path=tmp_path / "fake.log").start() as server:
        server.wait_healthy(timeout=FAKE_START_S)
        engine = SGLangEngine([server.url], servers=[server], bucket_bytes=2**20)
        port = free_port()
        group: list = []

        def push():
            engine.sync_weights_distributed(
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

        try:
            result = verify_update_overwrites_all(engine, push)
        finally:
            if group:
                engine.destroy_weights_update_group("g")
                dist.destroy_process_group(group[0])
        assert result.mismatched == [DROPPED], result.summary()
        assert "ignored the update of" in "\n".join(server.log_tail())
