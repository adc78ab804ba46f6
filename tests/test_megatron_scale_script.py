"""`benchmarks/megatron_scale.py` (the multi-GPU benchmark and the one-GPU fit sweep) runs end to end: two gloo
ranks at TP=2 with sequence parallelism and at CP=2 on a tiny preset, ragged rows packed, under the test-only CPU
shims; it writes its JSON with real
token counts, a finite loss and the memory estimate."""

from __future__ import annotations

import argparse
import json

import pytest

from rollflow.tasks.net import free_port

try:
    import megatron.core  # noqa: F401

    HAVE_MEGATRON = True
except ImportError:
    HAVE_MEGATRON = False

pytestmark = pytest.mark.skipif(not HAVE_MEGATRON, reason="needs megatron-core (pip install 'rollflow[megatron]')")


def _shimmed_rank(rank, world, port, args):
    from benchmarks import megatron_scale
    from tests.megatron_cpu_shim import cpu_megatron

    with cpu_megatron():
        megatron_scale._rank(rank, world, port, args)


@pytest.mark.parametrize("tp,cp,sp,name", [(2, 1, True, "tiny-tp2-pp1-dp1"), (1, 2, False, "tiny-tp1-pp1-cp2-dp1")])
def test_scale_benchmark_runs_packed_on_cpu(tmp_path, tp, cp, sp, name):
    import torch.multiprocessing as mp

    from benchmarks import megatron_scale

    args = argparse.Namespace(
        preset="tiny",
        tp=tp,
        pp=1,
        cp=cp,
        sp=sp,
        packing="thd",
        pack_multiple=1,
        ragged=True,
        seq=64,
        micro_batch=1,
        micro_batches=2,
        iters=1,
        spec="sdpa",
        no_recompute=False,
        no_dist_opt=False,
        device="cpu",
        out=str(tmp_path),
    )
    port = free_port("127.0.0.1")
    mp.spawn(_shimmed_rank, args=(2, port, args), nprocs=2, join=True)
    result = json.loads((tmp_path / f"megatron-scale-{name}-ragged-thd.json").read_text())
    lengths = megatron_scale._lengths(2, 64, True)
    assert result["real_tokens"] == int(lengths.sum()) < 2 * 64  # padding is not counted as work
    assert (result["tp"], result["cp"], result["packing"]) == (tp, cp, "thd")
    assert result["settings"]["use_distributed_optimizer"] and result["settings"]["sequence_parallel"] is sp
    assert result["loss"] == result["loss"] and result["grad_norm"] > 0  # finite, and it trained
