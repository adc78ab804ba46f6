"""The hf engine's static-cache decode loop (tasks/rollout/static_decode.py) against transformers' own
`generate` and a teacher-forced forward of the same tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rollflow.tasks.pinned import page_locked
from rollflow.tasks.rollout.engine import GenerationRequest, SamplingParams
from rollflow.tasks.rollout.hf_engine import HFEngine

PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12, 13, 14, 15, 16, 17], [1]]


def _model(device: str = "cpu", dtype=torch.float32, tie: bool = False):
    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
    )
    return Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def _teacher_forced(model, prompt, response, temperature):
    ids = torch.tensor([prompt + response], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1).cpu()


def test_greedy_equals_generate_and_stops_where_generate_stops():
    model = _model()
    requests = [GenerationRequest(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(7,))
    reference = HFEngine(model, pad_token_id=0, eos_token_id=2, static_cache=False).generate(requests, params)
    static = HFEngine(model, pad_token_id=0, eos_token_id=2, static_cache=True, length_bucket=1)
    assert static._decoder is None
    got = static.generate(requests, params)
    assert static._decoder is not None  # the loop under test ran, not transformers' generate
    for want, have in zip(reference, got):
        assert have[0].response_ids == want[0].response_ids
        assert have[0].finish_reason == want[0].finish_reason
        assert have[0].log_probs == pytest.approx(want[0].log_probs, abs=1e-5)
    assert {g[0].finish_reason for g in got} == {"stop", "length"}  # both cases covered


def test_sampled_log_probs_are_the_teacher_forced_ones_and_groups_differ():
    model = _model()
    engine = HFEngine(model, pad_token_id=0, eos_token_id=2, static_cache=True)
    params = SamplingParams(temperature=0.7, max_new_tokens=10, seed=3)
    groups = engine.generate([GenerationRequest(p, n=3) for p in PROMPTS], params)
    for prompt, group in zip(PROMPTS, groups):
        assert len({tuple(o.response_ids) for o in group}) == 3
        for out in group:
            want = _teacher_forced(model, prompt, out.response_ids, 0.7)
            assert torch.allclose(torch.tensor(out.log_probs), want, atol=1e-5)
    again = engine.generate([GenerationRequest(p, n=3) for p in PROMPTS], params)  # cache reused, same seed
    assert [[o.response_ids for o in g] for g in again] == [[o.response_ids for o in g] for g in groups]


def test_sampling_follows_the_softmax():
    """Gumbel-max draws: token frequencies match softmax(logits / T) of the first step."""
    model = _model()
    engine = HFEngine(model, pad_token_id=0, eos_token_id=-1, static_cache=True, max_batch_size=4096)
    params = SamplingParams(temperature=1.3, max_new_tokens=1, seed=0)
    outs = engine.generate([GenerationRequest([4, 5, 6], n=4000)], params)[0]
    counts = torch.bincount(torch.tensor([o.response_ids[0] for o in outs]), minlength=50).float() / 4000
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=torch.tensor([[4, 5, 6]])).logits[0, -1] / 1.3, -1)
    assert (counts - probs).abs().max() < 0.03
    assert outs[0].log_probs[0] == pytest.approx(float(probs[outs[0].response_ids[0]].log()), abs=1e-5)


def test_released_kv_caches_give_their_memory_back_and_return_for_the_next_call():
    """Colocation: release_memory frees every kept KV cache (the trainer trains in that memory); the next generate
    takes its cache back and decodes as before. Sizes from the model config: 2 layers x (K, V) x batch x 2 KV
    heads x length x 16 (head dim) x 4 bytes."""
    engine = HFEngine(_model(), pad_token_id=0, eos_token_id=2, static_cache=True, length_bucket=1)
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    sampled = SamplingParams(temperature=0.8, max_new_tokens=6, seed=11)
    requests = [GenerationRequest(p, n=2) for p in PROMPTS]
    first, first_sampled = engine.generate(requests, greedy), engine.generate(requests, sampled)
    width = max(len(p) for p in PROMPTS)
    kept = 2 * 2 * 8 * 2 * (width + 6) * 16 * 4  # one shape: 8 rows (4 prompts x 2), both calls
    assert engine.kv_cache_bytes() == kept
    engine.release_memory()
    assert engine.kv_cache_bytes() == 0
    engine.resume_memory(["weights"])
    engine.resume_memory(["kv_cache"])
    assert engine.generate(requests, greedy) == first
    assert engine.generate(requests, sampled) == first_sampled
    assert engine.kv_cache_bytes() == kept
    engine.release_memory(["weights"])  # weights only: the caches stay
    assert engine.kv_cache_bytes() == kept


def test_top_p_still_goes_through_generate():
    model = _model()
    engine = HFEngine(model, pad_token_id=0, eos_token_id=2, static_cache=True)
    engine.generate([GenerationRequest([1, 2])], SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=3, seed=1))
    assert engine._decoder is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_loop_on_gpu_matches_teacher_forcing():
    model = _model("cuda", torch.bfloat16)
    engine = HFEngine(model, pad_token_id=0, eos_token_id=2)
    assert engine.uses_static_cache
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=5)
    for _ in range(2):  # the second call reuses the compiled step and the cache
        groups = engine.generate([GenerationRequest(p, n=4) for p in PROMPTS], params)
    for prompt, group in zip(PROMPTS, groups):
        for out in group:
            want = _teacher_forced(model, prompt, out.response_ids, 1.0)
            assert (torch.tensor(out.log_probs) - want).abs().mean() < 0.05  # bf16 compiled vs eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_release_frees_the_gpu_and_resume_brings_back_every_bit_ties_and_the_compiled_loop():
    from rollflow.tasks.sync.parity import checksums

    model = _model("cuda", torch.bfloat16, tie=True)
    engine = HFEngine(model, pad_token_id=0, eos_token_id=2)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    requests = [GenerationRequest(p, n=2) for p in PROMPTS]
    before_out = engine.generate(requests, greedy)
    before = checksums(engine.weight_tensors())
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    engine.release_memory(["weights"])
    assert allocated - torch.cuda.memory_allocated() >= weight_bytes
    assert all(p.device.type == "cpu" and page_locked(p) for p in model.parameters())
    engine.resume_memory(["weights"])

    assert all(p.is_cuda for p in model.parameters())
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    assert checksums(engine.weight_tensors()) == before
    assert engine.generate(requests, greedy) == before_out  # the compiled step reads the moved weights

    # both tags (what RolloutWorker.release_memory asks): the KV caches' memory goes too, and comes back without a
    # recompilation (the cache tensors are the same objects; only their storage moved)
    from torch._dynamo.utils import counters

    kv = engine.kv_cache_bytes()
    assert kv > 0
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    engine.release_memory()
    assert allocated - torch.cuda.memory_allocated() >= weight_bytes + kv and engine.kv_cache_bytes() == 0
    graphs = dict(counters["stats"])
    engine.resume_memory(["weights"])
    engine.resume_memory(["kv_cache"])
    assert engine.generate(requests, greedy) == before_out
    assert engine.kv_cache_bytes() == kv
    assert dict(counters["stats"]).get("unique_graphs") == graphs.get("unique_graphs")  # nothing recompiled
