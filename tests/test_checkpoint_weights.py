"""An engine that starts from a checkpoint with no trainer running (e.g. a rollout-only run after training) reads
HF-named weights from every backend's checkpoint format."""

from __future__ import annotations

import pytest
import torch

from rollflow.tasks.model.source import resolve_model_path
from rollflow.tasks.model.tiny import load_model
from rollflow.tasks.train.checkpoint import distributed_payload
from rollflow.tasks.train.checkpoint_weights import hf_weights_of_checkpoint
from rollflow.tasks.train.settings import OptimConfig
from rollflow.tasks.train.worker import build_backend

MODEL = "builtin:addition"


def _hf_state() -> dict[str, torch.Tensor]:
    return load_model(resolve_model_path(MODEL), dtype=torch.float32, device="cpu").state_dict()


def test_torch_checkpoint_gives_its_weights():
    backend = build_backend(MODEL, OptimConfig(device="cpu", dtype="float32"), temperature=1.0)
    with torch.no_grad():
        next(backend.model.parameters()).add_(1.0)  # not the model's starting weights
    got = hf_weights_of_checkpoint(backend.checkpoint_bytes(), resolve_model_path(MODEL))
    want = backend.model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_megatron_checkpoint_is_converted_to_hf_names():
    pytest.importorskip("megatron.core", reason="needs megatron-core")
    backend = build_backend(
        MODEL,
        OptimConfig(backend="megatron", device="cpu", dtype="float32", megatron={"optimizer": "torch"}),
        temperature=1.0,
    )
    with torch.no_grad():
        next(backend.model.parameters()).add_(1.0)
    got = hf_weights_of_checkpoint(backend.checkpoint_bytes(), resolve_model_path(MODEL))
    assert set(got) == set(_hf_state())  # the HF model's own names (what the engine loads)
    want = backend.named_weights()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not all(torch.equal(got[k], v) for k, v in _hf_state().items())  # the trained weights, not the start


def test_sharded_checkpoint_names_the_fix():
    with pytest.raises(ValueError, match="sharded megatron trainer.*start the trainer first"):
        hf_weights_of_checkpoint(distributed_payload(), resolve_model_path(MODEL))


def test_alignment_drills_reach_a_megatron_trainers_reference():
    """The perturbed-reference drill moves the megatron backend's reference (a host copy, no second model), and
    the gibberish-weights drill keeps the reference equal to the scrambled policy (KL 0 at step 1 stays true)."""
    pytest.importorskip("megatron.core", reason="needs megatron-core")
    from rollflow.tasks.debug.alignment import trainer_perturb_ref, trainer_scramble
    from rollflow.tasks.train.batch import TrainBatch

    backend = build_backend(
        MODEL,
        OptimConfig(backend="megatron", device="cpu", dtype="float32", megatron={"optimizer": "torch"}),
        temperature=1.0,
    )
    tokens = torch.randint(3, 12, (4, 10), generator=torch.Generator().manual_seed(0))
    batch = TrainBatch(
        tokens=tokens,
        lengths=torch.full((4,), 10),
        response_mask=torch.ones(4, 9, dtype=torch.bool),
        rewards=torch.zeros(4),
        rollout_log_probs=torch.zeros(4, 9),
        group_size=4,
        truncated=torch.zeros(4, dtype=torch.bool),
    )
    assert torch.equal(backend.compute_log_probs(batch, "ref"), backend.compute_log_probs(batch, "policy"))
    assert not backend.compute_log_probs(batch).requires_grad  # scoring keeps no graph (old log-probs are data)
    trainer_perturb_ref(backend, 0.05, seed=1)
    assert not torch.equal(backend.compute_log_probs(batch, "ref"), backend.compute_log_probs(batch, "policy"))
    trainer_scramble(backend, "random", seed=2)
    assert torch.equal(backend.compute_log_probs(batch, "ref"), backend.compute_log_probs(batch, "policy"))
