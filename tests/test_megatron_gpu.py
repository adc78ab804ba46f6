"""The megatron TrainBackend against the torch backend (tasks/train/megatron/backend.py).

On a CUDA machine with megatron-core these run on the GPU (bf16, Megatron's optimizer); where
megatron-core is installed without CUDA (Python >= 3.12 dev boxes) the CPU path runs (sdpa spec, torch
AdamW on fp32 masters); where megatron-core is missing (CI, Python 3.11) they skip with the reason, and
only the "clear error" test runs.
"""

from __future__ import annotations

import math

import pytest
import torch

from rollflow.artifacts.sample import Sample
from rollflow.tasks.sync.parity import checksums, compare
from rollflow.tasks.train.batch import batch_from_samples
from rollflow.tasks.train.settings import AlgoConfig, OptimConfig
from rollflow.tasks.train.step import train_on_samples
from rollflow.tasks.train.torch_backend import TorchBackend

try:
    import megatron.core  # noqa: F401

    HAVE_MEGATRON = True
except ImportError:
    HAVE_MEGATRON = False

pytestmark = pytest.mark.gpu
needs_megatron = pytest.mark.skipif(
    not HAVE_MEGATRON, reason="needs megatron-core (pip install 'rollflow[megatron]', Python >= 3.12 for 0.17+)"
)
DEVICES = [
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
    # One device per process: after a CUDA test initialised NCCL, the CPU path (gloo) is not re-tested there.
    pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: GPU path tested")),
]


def _config(kind: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=300,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    if kind == "qwen2":
        return Qwen2Config(tie_word_embeddings=True, **common)
    if kind == "qwen3":  # q/k RMSNorm per head (Megatron's qk_layernorm), head_dim != hidden / heads
        return Qwen3Config(tie_word_embeddings=False, head_dim=48, **common)
    return LlamaConfig(tie_word_embeddings=False, **common)


def _hf(config, seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)  # biases and norms away from 0 / 1
    return model


def _samples(vocab: int, n: int = 8) -> list[Sample]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        plen, rlen = int(torch.randint(4, 20, (1,), generator=g)), int(torch.randint(5, 40, (1,), generator=g))
        out.append(
            Sample(
                group_index=i // 4,
                index=i,
                prompt="p",
                tokens=torch.randint(3, vocab, (plen + rlen,), generator=g).tolist(),
                response="",
                response_length=rlen,
                loss_mask=[1] * rlen,
                rollout_log_probs=[-5.0] * rlen,
                reward=float(i % 2),
            )
        )
    return out


def _optim(backend: str, device: str, dtype: str) -> OptimConfig:
    opt = "auto" if device == "cuda" else "torch"
    return OptimConfig(
        backend=backend,
        device=device,
        dtype=dtype,
        micro_batch_size=4,
        num_steps_per_rollout=1,
        lr=1e-4,
        megatron={"layer_spec": "sdpa", "optimizer": opt},
    )


@needs_megatron
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_log_probs_match_hf(device, kind):
    from rollflow.tasks.train.megatron.backend import MegatronBackend

    config = _config(kind)
    hf = _hf(config)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    batch = batch_from_samples(_samples(config.vocab_size), group_size=4)
    on = batch.response_mask > 0
    dtypes = ["float32", "bfloat16"] if device == "cuda" else ["float32"]
    for dtype in dtypes:
        ref = TorchBackend(_hf(config), _optim("torch", device, dtype), keep_ref=False).compute_log_probs(batch)
        mb = MegatronBackend(config, state, _optim("megatron", device, dtype), keep_ref=False)
        diff = (mb.compute_log_probs(batch) - ref)[on].abs()
        if dtype == "float32":
            assert float(diff.max()) < 2e-3, (dtype, float(diff.max()))
        else:
            assert float(diff.max()) < 0.5 and float(diff.mean()) < 0.03, (dtype, float(diff.max()), float(diff.mean()))


@needs_megatron
@pytest.mark.parametrize("device", DEVICES)
def test_step1_exact_and_weight_sync(device):
    from rollflow.tasks.train.megatron.backend import MegatronBackend

    config = _config("qwen2")
    hf = _hf(config)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    dtype = "bfloat16" if device == "cuda" else "float32"
    be = MegatronBackend(config, state, _optim("megatron", device, dtype))
    result = train_on_samples(be, _samples(config.vocab_size), AlgoConfig(), group_size=4)
    m = result.metrics
    assert m["rollout/log_probs_equal_ref"] == 1.0 and m["rollout/kl"] == 0.0
    assert m["train/ppo_kl"] == 0.0 and m["train/step1_ppo_kl"] == 0.0
    assert m["train/grad_norm"] > 0
    for name in (
        "train/loss",
        "train/pg_loss",
        "train/pg_clipfrac",
        "train/entropy_loss",
        "train/train_rollout_logprob_abs_diff",
    ):
        assert name in m
    # HF-named export: the engine loads it and the parity check passes unchanged.
    named = be.named_weights()
    engine = _hf(config, seed=5).to(getattr(torch, dtype))
    engine.load_state_dict(named, strict=True)
    assert compare(checksums(named), checksums(engine.state_dict())).ok
    # Checkpoint round trip.
    blob = be.checkpoint_bytes()
    be2 = MegatronBackend(config, state, _optim("megatron", device, dtype))
    be2.load_checkpoint_bytes(blob)
    assert compare(checksums(be2.named_weights()), checksums(named)).ok


@needs_megatron
@pytest.mark.parametrize("device", DEVICES)
def test_nan_gradient_skips_the_step_and_keeps_the_weights(device):
    """A NaN gradient (here injected by a hook) must not reach the weights: on CUDA Megatron's optimizer only
    checks for inf under fp16 loss scaling, so the backend looks at the reduced grads first."""
    from rollflow.tasks.train.megatron.backend import MegatronBackend

    config = _config("qwen2")
    state = {k: v.detach().clone() for k, v in _hf(config).state_dict().items()}
    dtype = "bfloat16" if device == "cuda" else "float32"
    be = MegatronBackend(config, state, _optim("megatron", device, dtype))
    before = checksums(be.named_weights())
    param = next(p for p in be.model.parameters() if p.requires_grad)
    hook = param.register_hook(lambda g: torch.full_like(g, float("nan")))
    result = train_on_samples(be, _samples(config.vocab_size), AlgoConfig(), group_size=4)
    hook.remove()
    assert result.metrics["train/skipped_steps"] == 1.0 and result.steps[0]["skipped"] == 1.0
    assert compare(checksums(be.named_weights()), before).ok
    result = train_on_samples(be, _samples(config.vocab_size), AlgoConfig(), group_size=4)
    assert result.metrics["train/skipped_steps"] == 0.0
    assert not compare(checksums(be.named_weights()), before).ok


@pytest.mark.skipif(HAVE_MEGATRON, reason="megatron-core is installed: the missing-package message cannot show")
def test_missing_megatron_is_a_clear_error():
    from rollflow.tasks.train.megatron.process import MegatronMissing
    from rollflow.tasks.train.worker import build_backend

    with pytest.raises(MegatronMissing, match=r"pip install 'rollflow\[megatron\]'.*Python >= 3.12"):
        build_backend("builtin:addition", OptimConfig(backend="megatron"), temperature=1.0)


@pytest.mark.parametrize("impl", ["chunked", "compiled"])
def test_fused_log_probs_match_log_softmax(impl):
    """The log-prob / entropy kernels (no megatron needed): values and gradients, vocab padding ignored."""
    from rollflow.tasks.train.losses import entropy_from_logits
    from rollflow.tasks.train.megatron.fused_ops import token_log_probs

    torch.manual_seed(0)
    logits = torch.randn(3, 7, 56, dtype=torch.float64, requires_grad=True)  # 50 real + 6 padded columns
    target = torch.randint(0, 50, (3, 7))
    w_lp, w_ent = torch.randn(3, 7, dtype=torch.float64), torch.randn(3, 7, dtype=torch.float64)
    lp, ent = token_log_probs(logits, target, temperature=0.8, vocab_size=50, chunk=5, impl=impl, entropy_grad=True)
    z = logits[..., :50] / 0.8
    ref_lp = torch.log_softmax(z, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    ref_ent = entropy_from_logits(z)
    assert torch.allclose(lp, ref_lp) and torch.allclose(ent, ref_ent)
    (g,) = torch.autograd.grad((lp * w_lp).sum() + (ent * w_ent).sum(), logits)
    (ref_g,) = torch.autograd.grad((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum(), logits)
    assert torch.allclose(g, ref_g) and torch.equal(g[..., 50:], torch.zeros(3, 7, 6, dtype=torch.float64))
    # bf16 logits: fp32 math, bf16 gradient; same values with and without grad (step-1 exactness)
    lb = logits.detach().to(torch.bfloat16).requires_grad_(True)
    lp16, _ = token_log_probs(lb, target, vocab_size=50, impl=impl)
    with torch.no_grad():
        lp16_nograd, _ = token_log_probs(lb, target, vocab_size=50, impl=impl)
    assert lp16.dtype == torch.float32 and torch.equal(lp16.detach(), lp16_nograd)
    lp16.sum().backward()
    assert lb.grad.dtype == torch.bfloat16


def test_compiled_rope_matches_rotate_half():
    from rollflow.tasks.train.megatron.fused_ops import rope_sbhd

    torch.manual_seed(0)
    s, b, h, d = 6, 2, 3, 8
    t = torch.randn(s, b, h, d, dtype=torch.float64, requires_grad=True)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.outer(torch.arange(s, dtype=torch.float64), inv)
    freqs = torch.cat((freqs, freqs), -1)[:, None, None, :]
    out = rope_sbhd(t, freqs)
    x1, x2 = t.chunk(2, -1)
    ref = t * freqs.cos() + torch.cat((-x2, x1), -1) * freqs.sin()
    assert torch.allclose(out, ref)
    w = torch.randn_like(out)
    (g,) = torch.autograd.grad((out * w).sum(), t)
    (ref_g,) = torch.autograd.grad((ref * w).sum(), t)
    assert torch.allclose(g, ref_g)


@needs_megatron
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("distributed_optimizer", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offload_frees_the_gpu_and_onload_resumes_exactly(distributed_optimizer, dtype):
    """Colocated placement: offload() moves weights, grad buffers and optimizer state (Adam moments, fp32 masters)
    to the host and frees them on the GPU; onload() brings every tensor back bit for bit, and training goes on."""
    from rollflow.tasks.train.megatron.backend import MegatronBackend
    from rollflow.tasks.train.megatron.optimizer import inner_optimizers

    config = _config("llama")
    state = {k: v.detach().clone() for k, v in _hf(config).state_dict().items()}
    batch = batch_from_samples(_samples(config.vocab_size), group_size=4)
    optim = OptimConfig(
        backend="megatron",
        device="cuda",
        dtype=dtype,
        micro_batch_size=4,
        num_steps_per_rollout=1,
        lr=1e-4,
        megatron={
            "layer_spec": "sdpa",
            "optimizer": "megatron",
            "fusions": "off",
            "log_prob_impl": "chunked",
            "rope_fusion": "none",
            "use_distributed_optimizer": distributed_optimizer,
        },
    )
    be = MegatronBackend(config, state, optim, keep_ref=False)
    batch.log_probs = be.compute_log_probs(batch)
    # train() takes a prepared batch (step.prepare_batch sets advantages); any fixed values do here
    batch.advantages = (
        torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0)) * batch.response_mask
    )
    be.train(batch, AlgoConfig())  # the optimizer state exists from the first step on

    def snapshot():
        weights = {k: v.detach().cpu().clone() for k, v in be.named_weights().items()}
        moments = [
            v.detach().cpu().clone()
            for inner in inner_optimizers(be.optimizer)
            for st in inner.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        ]
        masters = [
            p.detach().cpu().clone()
            for inner in inner_optimizers(be.optimizer)
            for g in inner.param_groups
            for p in g["params"]
        ]
        return weights, moments, masters

    torch.cuda.synchronize()
    before, allocated = snapshot(), torch.cuda.memory_allocated()
    n_params = sum(v.numel() for v in before[0].values())
    be.offload()
    freed = allocated - torch.cuda.memory_allocated()
    be.offload()  # a second call is a no-op
    be.onload()
    after = snapshot()
    bytes_per_param = 2 if dtype == "bfloat16" else 4
    # weights + main grads + Adam m and v at least (plus fp32 masters in bf16)
    assert freed >= (bytes_per_param + 4 + 8) * n_params, (freed, n_params)
    assert before[0].keys() == after[0].keys() and all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert len(before[1]) == len(after[1]) > 0 and all(torch.equal(a, b) for a, b in zip(before[1], after[1]))
    assert len(before[2]) == len(after[2]) and all(torch.equal(a, b) for a, b in zip(before[2], after[2]))
    stats = be.train(batch, AlgoConfig())  # trains on after onload: finite, and the weights move
    assert math.isfinite(stats["train/loss"]) and math.isfinite(stats["train/grad_norm"])
    moved = be.named_weights()
    assert any(not torch.equal(moved[k].cpu(), after[0][k]) for k in moved)
    # A later offload reuses the host buffers of the first (exact sizes, page-locked once) and still round-trips.
    shelf_bytes = be._shelf.nbytes()
    assert shelf_bytes >= (bytes_per_param + 8) * n_params  # weights and Adam moments at least
    again = snapshot()
    be.offload()
    be.onload()
    assert be._shelf.nbytes() == shelf_bytes
    last = snapshot()
    assert all(torch.equal(again[0][k], last[0][k]) for k in again[0])
    assert all(torch.equal(a, b) for a, b in zip(again[1] + again[2], last[1] + last[2]))


@needs_megatron
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_packed_rows_equal_padded_rows_on_gpu(kind):
    """packing='thd' (rows end to end, per-row SDPA and RoPE) gives the padded layout's log-probs, loss and grad
    norm on the GPU (fp32), with the CUDA defaults (compiled log-probs; the compiled RoPE is sbhd-only, so the
    packed model takes Megatron's per-row RoPE)."""
    from rollflow.tasks.train.megatron.backend import MegatronBackend

    config = _config(kind)
    state = {k: v.detach().clone() for k, v in _hf(config).state_dict().items()}
    batch = batch_from_samples(_samples(config.vocab_size), group_size=4)
    out = {}
    for packing in ("off", "thd"):
        optim = OptimConfig(
            backend="megatron",
            device="cuda",
            dtype="float32",
            micro_batch_size=4,
            num_steps_per_rollout=1,
            lr=1e-4,
            megatron={"layer_spec": "sdpa", "optimizer": "megatron", "packing": packing},
        )
        be = MegatronBackend(config, state, optim, keep_ref=False)
        lp = be.compute_log_probs(batch)
        b = batch_from_samples(_samples(config.vocab_size), group_size=4)
        b.log_probs = lp
        b.advantages = torch.randn(b.response_mask.shape, generator=torch.Generator().manual_seed(0)) * b.response_mask
        stats = be.train(b, AlgoConfig())
        out[packing] = (lp, stats)
    mask = batch.response_mask > 0
    torch.testing.assert_close(out["thd"][0][mask], out["off"][0][mask], rtol=0, atol=2e-5)
    assert out["thd"][1]["train/loss"] == pytest.approx(out["off"][1]["train/loss"], rel=1e-4, abs=1e-6)
    assert out["thd"][1]["train/grad_norm"] == pytest.approx(out["off"][1]["train/grad_norm"], rel=1e-4)


@needs_megatron
def test_packed_rope_equals_megatrons_per_row_rope():
    """rope_thd (positions found on the device) against megatron-core's own thd RoPE, values and gradients, with
    rows of uneven length and a padding segment."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    from rollflow.tasks.train.megatron.fused_ops import rope_thd

    class _OneRank:  # megatron-core's thd RoPE asks its cp group for size and rank
        def size(self):
            return 1

        def rank(self):
            return 0

    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32)
    h, d = 3, 8
    t = torch.randn(16, h, d, dtype=torch.float64, requires_grad=True)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.outer(torch.arange(7, dtype=torch.float64), inv)
    freqs = torch.cat((freqs, freqs), -1)[:, None, None, :]
    out = rope_thd(t, cu, freqs)
    ref = _apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=_OneRank())
    assert torch.allclose(out, ref)
    w = torch.randn_like(out)
    (g,) = torch.autograd.grad((out * w).sum(), t)
    (ref_g,) = torch.autograd.grad((ref * w).sum(), t)
    assert torch.allclose(g, ref_g)
    assert torch.allclose(out[5], t[5].detach())  # a one-token row sits at position 0: unrotated


@needs_megatron
@pytest.mark.parametrize("cp_rank", [0, 1])
def test_packed_rope_under_context_parallel_equals_megatrons(cp_rank):
    """The same at cp = 2: each rank holds chunks rank and 3 - rank of every row (the whole rows' bounds in
    `cu`), against megatron-core's own context-parallel thd RoPE."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    from rollflow.tasks.train.megatron.fused_ops import rope_thd

    class _Rank:
        def size(self):
            return 2

        def rank(self):
            return cp_rank

    torch.manual_seed(1)
    cu = torch.tensor([0, 8, 12, 24, 28], dtype=torch.int32)  # every row a multiple of 2 x cp
    h, d = 2, 8
    t = torch.randn(14, h, d, dtype=torch.float64, requires_grad=True)  # this rank's half of 28 tokens
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.outer(torch.arange(12, dtype=torch.float64), inv)
    freqs = torch.cat((freqs, freqs), -1)[:, None, None, :]
    out = rope_thd(t, cu, freqs, cp_size=2, cp_rank=cp_rank)
    ref = _apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=_Rank())
    assert torch.allclose(out, ref)
    w = torch.randn_like(out)
    (g,) = torch.autograd.grad((out * w).sum(), t)
    (ref_g,) = torch.autograd.grad((ref * w).sum(), t)
    assert torch.allclose(g, ref_g)


@needs_megatron
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_varlen_attention_equals_per_row_sdpa_in_bf16():
    """The packed layout's one variable-length flash call against one causal SDPA per row (bf16, GQA, rows of
    uneven length and a padding segment): outputs and gradients to bf16 round-off."""
    from rollflow.tasks.train.megatron.attention import varlen_causal_attention

    attend = varlen_causal_attention()
    if attend is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    torch.manual_seed(0)
    bounds = [0, 37, 38, 101, 160, 192]
    t, heads, groups, dim = bounds[-1], 8, 2, 64
    q, k, v = (
        torch.randn(t, h, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (heads, groups, groups)
    )
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    out = attend(q, k, v, cu, max(b - a for a, b in zip(bounds, bounds[1:])), dim**-0.5)
    ref = []
    for a, b in zip(bounds, bounds[1:]):
        qa, ka, va = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        ka, va = (x.repeat_interleave(heads // groups, dim=1) for x in (ka, va))
        ref.append(
            torch.nn.functional.scaled_dot_product_attention(qa, ka, va, is_causal=True, scale=dim**-0.5)[0].transpose(
                0, 1
            )
        )
    ref = torch.cat(ref)
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=2e-2)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=5e-2)
