"""train.megatron layout validation: one clear error naming the field, before any worker starts."""

from __future__ import annotations

import pytest

from rollflow.tasks.train.megatron.schedule import schedule_loss_scale
from rollflow.tasks.train.settings import MegatronSettings


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"sequence_parallel": True}, r"sequence_parallel=true needs train\.megatron\.tp > 1"),
        ({"vpp": 2}, r"vpp=2 needs train\.megatron\.pp > 1"),
        (
            {"cp": 2, "layer_spec": "local"},
            r"cp=2 needs an attention that sees the other cp ranks' keys.*layer_spec=sdpa",
        ),
        ({"recompute_granularity": "full"}, r"needs recompute_method"),
        ({"recompute_method": "uniform"}, r"apply to recompute_granularity='full' only"),
        ({"overlap_param_gather": True}, r"needs use_distributed_optimizer=true"),
        ({"lr_decay_style": "cosine"}, r"needs lr_decay_steps"),
    ],
)
def test_bad_layouts_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        MegatronSettings(**fields)


def test_torch_spec_takes_sequence_and_context_parallelism():
    """The sdpa spec builds both (its own norms and an all-gather attention; tests/test_megatron_parallel.py)."""
    s = MegatronSettings(tp=2, cp=2, sequence_parallel=True, layer_spec="sdpa")
    assert s.model_parallel_size == 4 and s.data_parallel_size(8) == 2


def test_data_parallel_size_and_model_checks():
    s = MegatronSettings(
        tp=2,
        pp=2,
        sequence_parallel=True,
        layer_spec="te",
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
    )
    assert s.data_parallel_size(8) == 2
    with pytest.raises(
        ValueError,
        match=r"world size 6 is not divisible by train\.megatron\.tp \* pp \* cp = "
        r"2 \* 2 \* 1",
    ):
        s.data_parallel_size(6)
    s.check_model(num_layers=4, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"num_hidden_layers=3 is not divisible by train\.megatron\.pp \* vpp = 2"):
        s.check_model(num_layers=3, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"num_key_value_heads=1 is not divisible by train\.megatron\.tp=2"):
        s.check_model(num_layers=4, num_kv_heads=1)


def test_run_config_checks_layout_against_trainer_gpus():
    from rollflow.flows.config import RunConfig

    with pytest.raises(ValueError, match=r"tp \* pp \* cp = 2 \* 1 \* 1.*resources\.trainer_gpus=3"):
        RunConfig.model_validate(
            {
                "train": {"backend": "megatron", "megatron": {"tp": 2}},
                "resources": {"trainer_gpus": 3, "gpus_per_engine": 1, "num_gpus": 4},
            }
        )


def test_a_sharded_trainer_needs_a_shared_filesystem():
    """tp / pp > 1 over several trainer ranks: Megatron's distributed checkpoints go to a filesystem path every
    rank writes; an object store is refused before any worker starts. Every SGLang sync path is accepted (the
    ranks gather the weights together for each)."""
    from rollflow.flows.config import RunConfig

    base = {
        "train": {"backend": "megatron", "device": "cuda", "megatron": {"tp": 2}},
        "resources": {"trainer_gpus": 2, "gpus_per_engine": 2, "num_gpus": 4, "num_engines": 1},
    }
    for mode in ("distributed", "tensor"):
        RunConfig.model_validate({**base, "rollout": {"engine": "sglang", "sglang": {"weight_sync": mode}}})
    with pytest.raises(ValueError, match=r"store\.root='s3://bucket/runs' is an object store"):
        RunConfig.model_validate({**base, "store": {"root": "s3://bucket/runs"}})
    RunConfig.model_validate({**base, "rollout": {"engine": "sglang", "sglang": {"weight_sync": "disk"}}})
    # data parallel only (tp = pp = 1, no distributed optimizer): every rank holds the whole state, anything goes
    RunConfig.model_validate(
        {**base, "train": {"backend": "megatron", "device": "cuda"}, "store": {"root": "s3://bucket/runs"}}
    )


def test_schedule_loss_scale_undoes_megatrons_means():
    # Megatron divides each micro-batch loss by the micro-batch count and averages grads over DP ranks.
    assert schedule_loss_scale(4, 2) == 8.0
    assert schedule_loss_scale(1, 1) == 1.0
    with pytest.raises(ValueError):
        schedule_loss_scale(0, 1)


def test_token_budget_micro_batches_cut_by_rows_times_longest_row():
    import torch

    from rollflow.tasks.train.batch import TrainBatch
    from rollflow.tasks.train.megatron.schedule import token_budget_micro_batches

    lengths, width = [5, 3, 8, 2, 2, 2, 9], 10
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    tokens = torch.arange(7 * width).reshape(7, width) * mask
    batch = TrainBatch(
        tokens=tokens,
        lengths=torch.tensor(lengths),
        response_mask=torch.ones(7, width - 1),
        rewards=torch.zeros(7),
        rollout_log_probs=torch.zeros(7, width - 1),
        group_size=1,
        truncated=torch.zeros(7, dtype=torch.bool),
    )
    micros = token_budget_micro_batches(batch, 12)
    # [5, 3] -> 2 x 5; 8 alone (2 x 8 > 12); [2, 2, 2] -> 3 x 2; 9 alone (over budget on its own)
    assert [tuple(m.tokens.shape) for m in micros] == [(2, 5), (1, 8), (3, 2), (1, 9)]
    assert [tuple(m.response_mask.shape) for m in micros] == [(2, 4), (1, 7), (3, 1), (1, 8)]
    assert torch.equal(torch.cat([m.tokens[:, :2] for m in micros]), tokens[:, :2])  # rows kept in order


def test_max_tokens_per_gpu_needs_pp_1():
    with pytest.raises(ValueError, match=r"max_tokens_per_gpu needs pp = 1"):
        MegatronSettings(pp=2, max_tokens_per_gpu=4096)
