"""The hf engine's bucketed weight sync (rollout.hf_weight_sync=tensor): the trainer's buckets land whole, in process
and serialized the way they cross between actors; an incomplete, mis-shaped or out-of-order sync never passes for a
complete one; RunConfig resolves and refuses the setting. The `gpu` test opens the trainer's buckets from another
process by CUDA IPC (scripts/gpu_checks.sh)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollflow.tasks.rollout.capabilities import BucketedWeightSync, TakesBuckets, WeightUpdateSession
from rollflow.tasks.rollout.hf_engine import HFEngine
from rollflow.tasks.sync import ipc
from rollflow.tasks.train.weight_sender import WeightSender, dict_buckets
from tests.test_engine_weight_update import _model as tiny_qwen2
from tests.test_engine_weight_update import _state

REPO = Path(__file__).resolve().parents[1]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SMALL_BUCKET = 4 << 10  # bytes: the tiny model comes in many buckets


def _model(seed: int, tie: bool = True, dtype=torch.float32, device: str = "cpu"):
    return tiny_qwen2(seed, tie, dtype).to(device)


def _buckets(state: dict[str, torch.Tensor], bucket_bytes: int = SMALL_BUCKET, dtype: str | None = None):
    return list(WeightSender(dict_buckets(lambda: state)).buckets(bucket_bytes, dtype))


def _assert_holds(engine: HFEngine, expected: dict[str, torch.Tensor]) -> None:
    got = engine.model.state_dict()
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value.to(got[name].dtype)), name


def test_the_engine_declares_the_tensor_path_and_reports_its_mode():
    engine = HFEngine(_model(1), pad_token_id=0, eos_token_id=2, weight_sync="tensor")
    for capability in (BucketedWeightSync, TakesBuckets, WeightUpdateSession):
        assert isinstance(engine, capability), capability.__name__
    assert engine.weight_sync == "tensor" and engine.payloads_per_bucket == 1
    assert HFEngine(_model(1), pad_token_id=0, eos_token_id=2).weight_sync == "object_store"
    with pytest.raises(ValueError, match="rollout.hf_weight_sync='nccl'"):
        HFEngine(_model(1), pad_token_id=0, eos_token_id=2, weight_sync="nccl")


@pytest.mark.parametrize("tie", [True, False])
def test_buckets_in_process_land_every_tensor_and_set_the_version_on_the_last(tie):
    engine = HFEngine(_model(1, tie=tie), pad_token_id=0, eos_token_id=2, weight_sync="tensor")
    sent = _state(_model(2, tie=tie))
    buckets = _buckets(sent)
    assert len(buckets) > 3 and [last for _, last in buckets] == [False] * (len(buckets) - 1) + [True]
    engine.begin_weight_update()
    for bucket, last in buckets:
        engine.apply_bucket(bucket, last=last, weight_version=1)
        assert engine.weight_version == (1 if last else 0)  # only the last bucket moves the version
    engine.end_weight_update()
    _assert_holds(engine, sent)
    if tie:
        assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight


def test_a_tied_weight_sent_once_counts_as_written():
    """A trainer that sends the shared tensor under one name only still completes the sync."""
    engine = HFEngine(_model(1), pad_token_id=0, eos_token_id=2, weight_sync="tensor")
    sent = _state(_model(2))
    sent.pop("lm_head.weight")
    for bucket, last in _buckets(sent):
        engine.apply_bucket(bucket, last=last, weight_version=1)
    assert engine.weight_version == 1
    assert torch.equal(engine.model.lm_head.weight, sent["model.embed_tokens.weight"])


def test_serialized_buckets_as_between_actors_cast_to_the_engine_dtype():
    """What crosses between two actors: WeightSender's payloads (by value on CPU, IPC handles on a GPU), in the
    engine's dtype, one flattened bucket per request."""
    engine = HFEngine(_model(1, dtype=torch.bfloat16), pad_token_id=0, eos_token_id=2, weight_sync="tensor")
    sent = _state(_model(3))  # the float32 trainer
    sender = WeightSender(dict_buckets(lambda: sent))
    sender.ipc_begin(SMALL_BUCKET, tp_size=1, dtype="bfloat16", flattened=True)
    engine.begin_weight_update()
    n, last = 0, False
    while not last:
        made = sender.ipc_next()
        last = made.last
        assert len(made.payloads) == 1
        engine.apply_serialized_bucket(made.payloads, last=last, weight_version=1, load_format=ipc.FLATTENED_BUCKET)
        n += 1
    sender.ipc_end()
    engine.end_weight_update()
    assert n > 3 and engine.weight_version == 1
    for name, value in engine.model.state_dict().items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, sent[name].to(torch.bfloat16)), name
    with pytest.raises(ValueError, match="one payload per bucket"):
        engine.apply_serialized_bucket(["a", "b"], last=True, weight_version=2)


def test_a_sync_missing_a_tensor_keeps_the_old_version_and_names_what_is_missing():
    engine = HFEngine(_model(1), pad_token_id=0, eos_token_id=2, weight_sync="tensor")
    sent = _state(_model(2))
    sent.pop("model.norm.weight")
    with pytest.raises(KeyError, match=r"never sent \(\['model.norm.weight'\]\).*keeps weight_version 0"):
        for bucket, last in _buckets(sent):
            engine.apply_bucket(bucket, last=last, weight_version=1)
    assert engine.weight_version == 0
    # the next complete sync of the same version goes through
    full = _state(_model(4))
    for bucket, last in _buckets(full):
        engine.apply_bucket(bucket, last=last, weight_version=1)
    assert engine.weight_version == 1
    _assert_holds(engine, full)


def test_an_abandoned_sync_does_not_count_towards_the_next_one():
    """The trainer died halfway (no last bucket); the next sync's session starts from nothing, so tensors only the
    abandoned one wrote do not make an incomplete sync look complete: whether the failed session's end reached the
    engine or not (the flow gives up waiting for it after a while)."""
    buckets = _buckets(_state(_model(2)))
    for ended in (True, False):
        engine = HFEngine(_model(1), pad_token_id=0, eos_token_id=2, weight_sync="tensor")
        engine.begin_weight_update()
        for bucket, _ in buckets[:-1]:
            engine.apply_bucket(bucket, last=False, weight_version=1)
        if ended:
            engine.end_weight_update()
        engine.begin_weight_update()
        with pytest.raises(KeyError, match="never sent"):
            engine.apply_bucket(buckets[-1][0], last=True, weight_version=1)
        assert engine.weight_version == 0


def test_bad_buckets_write_nothing_of_themselves():
    engine = HFEngine(_model(1), pad_token_id=0, eos_token_id=2, weight_sync="tensor")
    before = _state(engine.model)
    good = torch.ones_like(before["model.norm.weight"])
    with pytest.raises(ValueError, match="model.layers.0.input_layernorm.weight has shape"):
        engine.apply_bucket(
            [("model.norm.weight", good), ("model.layers.0.input_layernorm.weight", torch.ones(7))],
            last=False,
            weight_version=1,
        )
    with pytest.raises(KeyError, match="'model.nope'"):
        engine.apply_bucket([("model.norm.weight", good), ("model.nope", good)], last=False, weight_version=1)
    with pytest.raises(ValueError, match="weight_version 2 does not follow"):
        engine.apply_bucket([("model.norm.weight", good)], last=False, weight_version=2)
    _assert_holds(engine, before)
    assert engine.weight_version == 0


def test_run_config_resolves_auto_and_refuses_tensor_across_gpus():
    from rollflow.flows.config import RunConfig

    cpu = RunConfig()
    assert cpu.rollout.hf_weight_sync == "object_store"
    assert RunConfig(rollout={"hf_weight_sync": "tensor"}).rollout.hf_weight_sync == "tensor"  # CPU: by value
    gpu = {"num_gpus": 1, "trainer_gpus": 1, "num_engines": 1, "gpus_per_engine": 1}
    colocated = RunConfig(placement="colocate", resources=gpu, rollout={"device": "cuda"}, train={"device": "cuda"})
    assert colocated.rollout.hf_weight_sync == "tensor"
    assert any("hf_weight_sync=auto -> 'tensor'" in n for n in colocated.notices)
    apart = RunConfig(resources={**gpu, "num_gpus": 2}, rollout={"device": "cuda"}, train={"device": "cuda"})
    assert apart.rollout.hf_weight_sync == "object_store"
    with pytest.raises(ValueError, match="rollout.hf_weight_sync='tensor' with placement='disaggregated'"):
        RunConfig(
            resources={**gpu, "num_gpus": 2},
            rollout={"device": "cuda", "hf_weight_sync": "tensor"},
            train={"device": "cuda"},
        )


# ----------------------------------------------------------------------------------------------
# GPU: the trainer's buckets opened from another process by CUDA IPC
# ----------------------------------------------------------------------------------------------

SENDER = """
import sys, torch
from rollflow.tasks.train.weight_sender import WeightSender, dict_buckets
from tests.test_engine_weight_update import _model as tiny_qwen2
from tests.test_engine_weight_update import _state
sys.path.insert(0, sys.argv[2])
from test_hf_bucket_sync import _model, _state
sent = {k: v.cuda() for k, v in _state(_model(7)).items()}
sender = WeightSender(dict_buckets(lambda: sent))
sender.ipc_begin(int(sys.argv[3]), tp_size=1, dtype="bfloat16", device="cuda", flattened=True)
last = False
while not last:
    made = sender.ipc_next()  # holds this bucket until the next one is asked for
    last = made.last
    print(int(last), made.payloads[0], flush=True)
    assert sys.stdin.readline().strip() == "next"
sender.ipc_end()
"""


@pytest.mark.gpu
@needs_cuda
def test_cuda_buckets_from_another_process_land_bit_for_bit():
    engine = HFEngine(
        _model(1, dtype=torch.bfloat16, device="cuda"), pad_token_id=0, eos_token_id=2, weight_sync="tensor"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(
        [sys.executable, "-c", SENDER, "", str(REPO / "tests"), str(SMALL_BUCKET * 4)],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        engine.begin_weight_update()
        n, last = 0, False
        while not last:
            flag, payload = proc.stdout.readline().split()
            last = flag == "1"
            assert len(payload) < 20_000  # a handle, not the bytes
            engine.apply_serialized_bucket([payload], last=last, weight_version=1, load_format=ipc.FLATTENED_BUCKET)
            proc.stdin.write("next\n")
            proc.stdin.flush()
            n += 1
        engine.end_weight_update()
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
    expected = _state(_model(7))  # the sender's weights, made here independently on the CPU
    assert n > 1 and engine.weight_version == 1
    for name, value in engine.model.state_dict().items():
        assert torch.equal(value.cpu(), expected[name].to(torch.bfloat16)), name
