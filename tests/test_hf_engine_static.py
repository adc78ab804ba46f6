"""The hf engine's static-cache option (issue 11): shapes bucketed, outputs and log-probs unchanged in meaning."""

from __future__ import annotations

import pytest
import torch

from rollflow.tasks.model.tiny import build_tiny_model
from rollflow.tasks.rollout.engine import GenerationRequest, SamplingParams
from rollflow.tasks.rollout.hf_engine import HFEngine, _StepLogProbs
from rollflow.tasks.rollout.settings import RolloutConfig


@pytest.fixture(scope="module")
def tiny():
    model, tok = build_tiny_model(seed=0, max_positions=256)
    return model.eval(), tok


def test_static_cache_setting_resolves_per_device(tiny):
    model, tok = tiny
    assert not HFEngine(model, pad_token_id=0, eos_token_id=2).uses_static_cache  # auto: off on CPU
    assert HFEngine(model, pad_token_id=0, eos_token_id=2, static_cache=True).uses_static_cache
    with pytest.raises(ValueError, match="static_cache"):
        HFEngine(model, pad_token_id=0, eos_token_id=2, static_cache="yes")
    assert RolloutConfig().static_cache == "auto"
    assert RolloutConfig(static_cache=True).static_cache is True
    with pytest.raises(ValueError):
        RolloutConfig(static_cache="sometimes")


def test_step_recorder_equals_output_logits(tiny):
    model, tok = tiny
    torch.manual_seed(0)
    ids = torch.randint(3, tok.vocab_size, (5, 7))
    recorder = _StepLogProbs(0.7)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=0.7,
        top_k=0,
        top_p=1.0,
        max_new_tokens=9,
        eos_token_id=[2],
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
        logits_processor=[recorder],
    )
    new = out.sequences[:, 7:]
    expected = torch.log_softmax(torch.stack(out.logits, 1).float() / 0.7, -1).gather(-1, new[..., None])[..., 0]
    assert torch.equal(recorder.finish(new), expected)


def test_static_cache_pads_batch_and_width_and_drops_the_padding(tiny):
    model, tok = tiny
    engine = HFEngine(model, pad_token_id=0, eos_token_id=2, static_cache=True, length_bucket=16)
    requests = [GenerationRequest([1, 3, 4, 5], n=3), GenerationRequest([1, 6, 7], n=2)]  # 5 rows -> 8
    out = engine.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=6, seed=3))
    assert [len(g) for g in out] == [3, 2]
    for group in out:
        for o in group:
            assert 1 <= len(o.response_ids) <= 6 and len(o.log_probs) == len(o.response_ids)
            assert o.finish_reason in ("stop", "length")
            # log-probs of the sampled tokens under the full softmax: finite and <= 0
            assert all(lp <= 0 and lp == lp for lp in o.log_probs)
    # Teacher-forced log-probs of what the static path sampled agree to fp32 noise.
    o = out[0][0]
    ids = torch.tensor([[1, 3, 4, 5] + o.response_ids])
    logits = model(input_ids=ids).logits[0, 3:-1].float()
    ref = torch.log_softmax(logits, -1).gather(-1, ids[0, 4:, None])[:, 0]
    assert torch.allclose(ref, torch.tensor(o.log_probs), atol=1e-4)
