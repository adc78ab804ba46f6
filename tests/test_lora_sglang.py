"""A LoRA run's adapter sync into SGLang (rollout.sglang.lora_sync=adapter) against the fake SGLang server, which
keeps SGLang 0.5.23's LoRA rules and serves a request naming an adapter with W + (alpha / r) * B @ A.

The trainer side is the real LoraTorchBackend; what the fake serves is compared with the trainer's own merge (the
weights the merged path would send), and the fake's tokens follow the weights it serves, so a request naming the
adapter must generate what a server holding the trainer's merged weights generates. SGLang's own request
structures judge these bodies in tests/test_sglang_own_code.py."""

from __future__ import annotations

import httpx
import pytest
import torch

from rollflow.tasks.model.source import resolve_model_path
from rollflow.tasks.model.tiny import load_model
from rollflow.tasks.rollout.engine import GenerationRequest, SamplingParams
from rollflow.tasks.rollout.sglang.engine import SGLangEngine
from rollflow.tasks.rollout.sglang.hf_checkpoint import write_hf_checkpoint
from rollflow.tasks.rollout.sglang.payloads import SGLangRequestError, generate_payload
from rollflow.tasks.sync.parity import checksums
from rollflow.tasks.train.lora_backend import LoraTorchBackend
from rollflow.tasks.train.settings import LORA_DEFAULT_TARGETS, LoraSettings, OptimConfig
from tests.fake_sglang_server import FakeSGLang

pytest.importorskip("peft")

MODEL = resolve_model_path("builtin:addition")
LORA = LoraSettings(rank=4, alpha=8.0)
LORA_ARGS = ["--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", *LORA_DEFAULT_TARGETS]
PROMPT = [1, 5, 6, 7]
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 6}


def trained_backend(seed: int) -> LoraTorchBackend:
    """A LoRA policy whose B moved (as after training steps): the merge differs from the base."""
    backend = LoraTorchBackend(load_model(MODEL), OptimConfig(), LORA)
    move_adapter(backend, seed)
    return backend


def move_adapter(backend: LoraTorchBackend, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in backend.model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)


def tokens(url: str, lora: str | None = None) -> tuple[int, list]:
    """One /generate with a fixed rid (the fake's tokens depend on it), optionally naming an adapter."""
    r = httpx.post(f"{url}/generate", json=generate_payload(PROMPT, SAMPLING, "fixed.", lora_path=lora), timeout=30)
    return r.status_code, r.json()["output_ids"] if r.status_code == 200 else r.json()


@pytest.mark.parametrize("weight_sync", ["tensor", "disk"])
def test_adapter_sync_serves_the_trainers_merged_weights(tmp_path, weight_sync):
    backend = trained_backend(0)
    tp = 2 if weight_sync == "tensor" else 1  # one serialized copy per TP rank; the fake checks they agree
    with FakeSGLang(model_path=str(MODEL), dtype="float32", tp_size=tp, extra_args=LORA_ARGS) as fake:
        engine = SGLangEngine(
            [fake.url], weight_sync=weight_sync, weight_dir=tmp_path / "w", tp_sizes=tp, lora_sync="adapter"
        )
        engine.generate([GenerationRequest(PROMPT)], SamplingParams(max_new_tokens=2))
        assert "lora_path" not in fake.calls("/generate")[-1][2]  # before the first sync: the base (B = 0 at start)
        base_tokens = tokens(fake.url)

        adapter = backend.lora_adapter()
        assert engine.update_lora_adapter(adapter["tensors"], adapter["config"], 1) == "rollflow-v1"
        route = "/load_lora_adapter" if weight_sync == "disk" else "/load_lora_adapter_from_tensors"
        assert [p for p in fake.paths() if "lora" in p] == [route]
        merged = backend.named_weights()  # what lora_sync=merged would have sent
        served = fake.lora_served("rollflow-v1")
        assert set(merged) - set(served) == {"lm_head.weight"}  # tied to the embedding, which the server holds
        differ = [n for n in served if not torch.equal(merged[n], load_model_weight(MODEL, n))]
        assert len(differ) == 2 * len(LORA_DEFAULT_TARGETS)  # every adapted projection of both layers moved
        assert all(torch.equal(served[n], merged[n]) for n in served)

        engine.generate([GenerationRequest(PROMPT, n=2)], SamplingParams(max_new_tokens=2))
        assert fake.calls("/generate")[-1][2]["lora_path"] == "rollflow-v1"
        assert tokens(fake.url, "rollflow-v1") != base_tokens  # the adapter is applied
        merged_dir = write_hf_checkpoint(merged, tmp_path / "merged", config_dir=MODEL)
        with FakeSGLang(model_path=str(merged_dir), dtype="float32", extra_args=LORA_ARGS) as plain:
            assert tokens(plain.url) == tokens(fake.url, "rollflow-v1")  # = a server holding the merged weights

        move_adapter(backend, 1)  # the next training step
        adapter = backend.lora_adapter()
        assert engine.update_lora_adapter(adapter["tensors"], adapter["config"], 2) == "rollflow-v2"
        assert fake.state()["loras"].keys() == {"rollflow-v2"}  # the old adapter unloaded after the new loaded
        lora_calls = [p for p in fake.paths() if "lora" in p or p == "/update_weight_version"]
        assert lora_calls == [route, "/update_weight_version", route, "/unload_lora_adapter", "/update_weight_version"]
        merged = backend.named_weights()
        served = fake.lora_served("rollflow-v2")
        assert all(torch.equal(served[n], merged[n]) for n in served)
        assert engine.model_info()["weight_version"] == "2" and engine.weight_version == 2
        report = engine.lora_report()
        assert report["name"] == "rollflow-v2" and report["listed"] == {fake.url: fake.state()["loras"]}
        assert report["checksums"] == checksums(adapter["tensors"])
        assert report["checksums"] != checksums(trained_backend(0).lora_adapter()["tensors"])

        # a re-sync of the same version loads beside the current adapter under another name
        assert engine.update_lora_adapter(adapter["tensors"], adapter["config"], 2) == "rollflow-v2-r2"
        assert fake.state()["loras"].keys() == {"rollflow-v2-r2"}

        # SGLang reloads an unloaded adapter named by a request from its path: a directory can be (the engine keeps
        # the newest two), tensors cannot
        status, body = tokens(fake.url, "rollflow-v2")
        if weight_sync == "disk":
            assert status == 200 and len(list((tmp_path / "w").glob("lora-v*"))) == 2
            status, body = tokens(fake.url, "rollflow-v1")  # its directory is gone
        assert status == 400 and "Failed to implicitly load LoRA adapter" in body["error"]["message"]
        assert not fake.dead
        with pytest.raises(RuntimeError, match="adapter twice"):
            engine.update_weights(merged, 3)  # merged weights on a base + adapter server would double the update
        engine.shutdown()


def load_model_weight(path, name: str) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))[name]


def test_sglangs_lora_rules_in_the_fake(tmp_path):
    adapter = trained_backend(0).lora_adapter()
    with FakeSGLang(model_path=str(MODEL), dtype="float32") as off:  # launched without --enable-lora
        engine = SGLangEngine([off.url], weight_sync="tensor", lora_sync="adapter")
        with pytest.raises(SGLangRequestError, match="LoRA is not enabled"):
            engine.update_lora_adapter(adapter["tensors"], adapter["config"], 1)
        status, body = tokens(off.url, "rollflow-v1")
        assert status == 400 and "LoRA is not enabled" in body["error"]["message"]
        assert engine.lora_name is None and engine.weight_version == 0
    small = ["--enable-lora", "--max-lora-rank", "2", "--lora-target-modules", "q_proj", "v_proj"]
    with FakeSGLang(model_path=str(MODEL), dtype="float32", extra_args=small) as narrow:
        engine = SGLangEngine([narrow.url], weight_sync="tensor", lora_sync="adapter")
        with pytest.raises(SGLangRequestError, match="incompatible with the current LoRA memory pool"):
            engine.update_lora_adapter(adapter["tensors"], adapter["config"], 1)
    with FakeSGLang(model_path=str(MODEL), dtype="float32", extra_args=LORA_ARGS) as fake:
        engine = SGLangEngine([fake.url], weight_sync="tensor", lora_sync="adapter")
        engine.update_lora_adapter(adapter["tensors"], adapter["config"], 1)
        for path, body, needle in [
            ("/unload_lora_adapter", {"lora_name": "nope"}, "LoRA with name nope does not exist"),
            (
                "/load_lora_adapter",
                {"lora_name": "rollflow-v1", "lora_path": str(tmp_path / "gone")},
                "is not a directory",
            ),
        ]:
            with pytest.raises(SGLangRequestError, match=needle):
                engine._post(fake.url, path, body)
        engine.lora_loads = 0  # a name already loaded: SGLang answers 400 and keeps serving the loaded one
        engine.lora_name = None
        with pytest.raises(SGLangRequestError, match="rollflow-v1 because it is already loaded"):
            engine.update_lora_adapter(adapter["tensors"], adapter["config"], 1)
        assert fake.state()["loras"].keys() == {"rollflow-v1"}
        status, body = tokens(fake.url, "rollflow-v9")
        assert status == 400 and "never been loaded" in body["error"]["message"]
        bad = dict(adapter["tensors"])
        name = next(n for n in bad if n.endswith("lora_A.weight"))
        bad[name] = torch.zeros(3, 3)
        with pytest.raises(SGLangRequestError, match=r"shape \(3, 3\)"):
            engine.update_lora_adapter(bad, adapter["config"], 2)
        assert not fake.dead


def test_two_servers_a_failed_load_leaves_the_previous_adapter_everywhere():
    adapter = trained_backend(0).lora_adapter()
    narrow = ["--enable-lora", "--max-lora-rank", "2", "--lora-target-modules", *LORA_DEFAULT_TARGETS]
    with (
        FakeSGLang(model_path=str(MODEL), dtype="float32", extra_args=LORA_ARGS) as a,
        FakeSGLang(model_path=str(MODEL), dtype="float32", extra_args=narrow) as b,
    ):
        engine = SGLangEngine([a.url, b.url], weight_sync="tensor", lora_sync="adapter")
        with pytest.raises(SGLangRequestError, match="incompatible"):
            engine.update_lora_adapter(adapter["tensors"], adapter["config"], 1)
        assert a.state()["loras"] == {} and b.state()["loras"] == {}  # the first server's load undone
        assert engine.lora_name is None and engine.weight_version == 0


def test_lora_sync_config(tmp_path):
    from rollflow.flows.config_loading import ConfigError, load_config
    from rollflow.tasks.rollout.sglang.from_config import launch_spec_for
    from rollflow.tasks.rollout.sglang.server import launch_command

    base = ["model.lora.rank=4", "rollout.engine=sglang", "rollout.sglang.lora_sync=adapter"]
    cfg = load_config(None, base)
    sg = cfg.rollout.sglang
    assert (sg.lora_max_rank, sg.lora_target_modules) == (4, list(LORA_DEFAULT_TARGETS))
    argv = launch_command(launch_spec_for("/m", cfg.rollout, port=30000))
    at = argv.index("--lora-target-modules")
    assert argv[argv.index("--enable-lora") + 1 : at] == ["--max-lora-rank", "4"]
    assert argv[at + 1 :] == list(LORA_DEFAULT_TARGETS)
    assert any("/load_lora_adapter" in n for n in cfg.notices)  # disaggregated default: disk
    assert "--enable-lora" not in launch_command(launch_spec_for("/m", load_config(None, base[:2]).rollout, port=1))
    assert any("lora_sync=adapter sends only the adapter" in n for n in load_config(None, base[:2]).notices)
    refusals = {
        (
            "rollout.engine=sglang",
            "rollout.sglang.lora_sync=adapter",
        ): "rollout.sglang.lora_sync='adapter' without model.lora",
        ("model.lora.rank=4", "rollout.sglang.lora_sync=adapter"): "set rollout.engine='sglang'",
        (*base, "rollout.sglang.args.max-lora-rank=8"): "rollout.sglang.args sets --max-lora-rank",
        (*base, "rollout.sglang.lora_max_rank=2"): "rollout.sglang.lora_max_rank=2 < model.lora.rank=4",
        (*base, 'rollout.sglang.lora_target_modules=["q_proj"]'): "rollout.sglang.lora_target_modules lacks",
        (*base, "train.backend=megatron"): "model.lora needs train.backend=torch",
        (*base, "rollout.sglang.lora_sync=both"): "rollout.sglang.lora_sync",
    }
    for extra, needle in refusals.items():
        with pytest.raises(ConfigError) as err:
            load_config(None, list(extra))
        assert needle in str(err.value), (extra, str(err.value))
        assert str(err.value).count("\n") <= 1
