"""HFEngine.update_weights: every tensor lands, tied parameters, casts, and bad updates refused."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rollflow.tasks.rollout import hf_engine
from rollflow.tasks.rollout.hf_engine import HFEngine


def _model(seed: int, tie: bool = True, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        tie_word_embeddings=tie,
    )
    return Qwen2ForCausalLM(cfg).to(dtype)


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("memcpy_bytes", [8 << 20, 0, 1 << 40], ids=["mixed", "all-memcpy", "all-foreach"])
def test_every_tensor_lands_and_ties_stay_tied(monkeypatch, memcpy_bytes):
    monkeypatch.setattr(hf_engine, "_MEMCPY_BYTES", memcpy_bytes)
    engine = HFEngine(_model(1), pad_token_id=0, eos_token_id=2)
    trainer = _model(2)
    sent = _state(trainer)
    sent["lm_head.weight"] = sent["model.embed_tokens.weight"]  # tied in the trainer too: one tensor
    engine.update_weights(sent, 1)
    got = engine.model.state_dict()
    assert set(got) == set(sent)
    for name, value in sent.items():
        assert torch.equal(got[name], value), name
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    assert engine.resident.aliases() == {"lm_head.weight": "model.embed_tokens.weight"}
    assert engine.weight_version == 1


def test_untied_sources_for_a_tied_engine_are_both_written():
    """An untied trainer sends two different tensors: nothing is skipped (the later name wins, as before)."""
    engine = HFEngine(_model(1), pad_token_id=0, eos_token_id=2)
    sent = _state(_model(2))
    sent["lm_head.weight"] = torch.randn_like(sent["model.embed_tokens.weight"])
    engine.update_weights(sent, 1)
    assert torch.equal(engine.model.lm_head.weight, sent["lm_head.weight"])


def test_cast_on_copy_and_resident_views_follow_device_moves():
    engine = HFEngine(_model(1, dtype=torch.bfloat16), pad_token_id=0, eos_token_id=2)
    sent = _state(_model(3))  # float32 trainer, bf16 engine
    engine.update_weights(sent, 1)
    for name, value in engine.model.state_dict().items():
        assert value.dtype == torch.bfloat16
        assert torch.equal(value, sent[name].to(torch.bfloat16)), name
    engine.release_memory()
    engine.resume_memory()
    sent2 = _state(_model(4))
    engine.update_weights(sent2, 2)  # cached Parameter objects are still the model's
    assert torch.equal(engine.model.model.norm.weight, sent2["model.norm.weight"].to(torch.bfloat16))


def test_bad_updates_are_refused_before_anything_is_written():
    engine = HFEngine(_model(1), pad_token_id=0, eos_token_id=2)
    before = _state(engine.model)
    sent = _state(_model(2))
    wrong = dict(sent)
    wrong["model.norm.weight"] = torch.ones(7)
    with pytest.raises(ValueError, match="model.norm.weight has shape"):
        engine.update_weights(wrong, 1)
    missing = dict(sent)
    missing.pop("model.norm.weight")
    with pytest.raises(KeyError, match="missing"):
        engine.update_weights(missing, 1)
    for name, value in engine.model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert engine.weight_version == 0


def test_repeated_updates_from_resident_tensors_land_each_time():
    """The trainer's own tensors, changed in place between updates (same addresses: the engine reuses its
    copy plan), and a host-staged update in between (another plan) must not disturb that."""
    engine = HFEngine(_model(1), pad_token_id=0, eos_token_id=2)
    trainer = _model(2)
    resident = dict(trainer.state_dict(keep_vars=True))
    version = 0
    for step in range(4):
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(0.5)
        if step == 2:
            version += 1
            engine.update_weights(_state(_model(9)), version)  # a host copy, then the resident ones again
        version += 1
        engine.update_weights({k: v.detach() for k, v in resident.items()}, version)
        for name, value in engine.model.state_dict().items():
            assert torch.equal(value, resident[name].detach()), (version, name)
    assert len(engine._copy_plans) == 2
