"""Colocated placement with offload=true: the trainer's weights, grads and optimizer state go to host memory
while the engine generates, and come back bit for bit before training (TorchBackend here; the megatron
backend's offload is tested in tests/test_megatron_gpu.py). On CPU there is no GPU memory to free: a no-op."""

from __future__ import annotations

import pytest
import torch

from rollflow.tasks.train.batch import batch_from_samples
from rollflow.tasks.train.settings import AlgoConfig, OptimConfig
from rollflow.tasks.train.step import train_on_samples
from rollflow.tasks.train.torch_backend import TorchBackend
from tests.test_megatron_gpu import _config, _hf, _samples


def _backend(device: str) -> TorchBackend:
    optim = OptimConfig(
        backend="torch", device=device, dtype="float32", micro_batch_size=4, num_steps_per_rollout=1, lr=1e-4
    )
    return TorchBackend(_hf(_config("qwen2")), optim)


def _state(be: TorchBackend) -> tuple[dict, list]:
    weights = {k: v.detach().cpu().clone() for k, v in be.model.state_dict().items()}
    ref = {k: v.detach().cpu().clone() for k, v in be.ref_model.state_dict().items()}
    moments = [
        v.detach().cpu().clone()
        for st in be.optimizer.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    ]
    return (weights, ref), moments


def test_offload_is_a_no_op_on_cpu():
    be = _backend("cpu")
    before = be.model.lm_head.weight
    be.offload()
    assert be.model.lm_head.weight.data_ptr() == before.data_ptr()
    be.onload()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_torch_backend_offload_frees_the_gpu_and_onload_restores_bit_for_bit():
    config = _config("qwen2")
    be = _backend("cuda")
    samples = _samples(config.vocab_size)
    train_on_samples(be, samples, AlgoConfig(), group_size=4)  # AdamW state exists after a step
    (weights, ref), moments = _state(be)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    n_params = sum(p.numel() for p in be.model.parameters())
    be.offload()
    be.offload()  # no-op
    freed = allocated - torch.cuda.memory_allocated()
    assert freed >= (4 + 4 + 8) * n_params, (freed, n_params)  # policy + reference + Adam m, v (fp32)
    assert not be.model.lm_head.weight.is_cuda
    be.onload()
    (weights2, ref2), moments2 = _state(be)
    assert all(torch.equal(weights[k], weights2[k]) for k in weights)
    assert all(torch.equal(ref[k], ref2[k]) for k in ref)
    assert len(moments) == len(moments2) > 0 and all(torch.equal(a, b) for a, b in zip(moments, moments2))
    assert be.model.lm_head.weight.is_cuda
    # tied embeddings stay tied, and training goes on from the restored state
    assert be.model.lm_head.weight.data_ptr() == be.model.model.embed_tokens.weight.data_ptr()
    metrics = train_on_samples(be, samples, AlgoConfig(), group_size=4).metrics
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    batch = batch_from_samples(samples, group_size=4)
    assert be.compute_log_probs(batch).isfinite().all()
