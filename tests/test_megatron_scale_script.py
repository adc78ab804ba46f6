"""`benchmarks/megatron_scale.py` (the multi-GPU benchmark and the one-GPU fit sweep) runs end to end: two gloo
ranks at TP=2 on a tiny preset, ragged rows packed, under the test-only CPU shims; it writes its JSON with real
token counts, a finite loss and the memory estimate."""

from __future__ import annotations

import argparse
import json
import socket

import pytest

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


def test_scale_benchmark_runs_tp2_packed_on_cpu(tmp_path):
    import torch.multiprocessing as mp

    from benchmarks import megatron_scale

    args = argparse.Namespace(preset="tiny", tp=2, pp=1, sp=False, packing="thd", pack_multiple=1, ragged=True,
                              seq=64, micro_batch=1, micro_batches=2, iters=1, spec="sdpa", no_recompute=False,
                              no_dist_opt=False, device="cpu", out=str(tmp_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_shimmed_rank, args=(2, port, args), nprocs=2, join=True)
    result = json.loads((tmp_path / "megatron-scale-tiny-tp2-pp1-dp1-ragged-thd.json").read_text())
    lengths = megatron_scale._lengths(2, 64, True)
    assert result["real_tokens"] == int(lengths.sum()) < 2 * 64  # padding is not counted as work
    assert result["tp"] == 2 and result["packing"] == "thd" and result["settings"]["use_distributed_optimizer"]
    assert result["loss"] == result["loss"] and result["grad_norm"] > 0  # finite, and it trained
