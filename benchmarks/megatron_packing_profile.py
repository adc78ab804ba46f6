"""One train() call of the ~0.9B megatron backend under torch.profiler, padded vs packed rows (packing='thd').

    # one CUDA GPU; megatron-core installed (or scripts/use_checkout.sh)
    python3 benchmarks/megatron_packing_profile.py

Rows of uniform random length in [1024, 4096] (8 of them, one per micro-batch), full recompute, the distributed
optimizer, bf16. Prints, per layout, the wall time of one call and the profiler's tables (by CUDA time, by host time).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks import megatron_scale  # noqa: E402


def main() -> None:
    from rollflow.tasks.train.data_parallel import DataParallel
    from rollflow.tasks.train.megatron.backend import MegatronBackend
    from rollflow.tasks.train.megatron.process import destroy_parallel_state
    from rollflow.tasks.train.settings import AlgoConfig, OptimConfig

    torch.cuda.set_device(0)
    config = megatron_scale._llama("0.9b")
    for port, packing in enumerate(("off", "thd"), start=29511):
        megatron = {
            "packing": packing,
            "use_distributed_optimizer": True,
            "layer_spec": "sdpa",
            "optimizer": "megatron",
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        }
        optim = OptimConfig(
            backend="megatron",
            device="cuda:0",
            dtype="bfloat16",
            lr=1e-6,
            num_steps_per_rollout=1,
            micro_batch_size=1,
            megatron=megatron,
        )
        be = MegatronBackend(
            config, None, optim, keep_ref=False, dp=DataParallel(0, 1, "127.0.0.1", port, backend="nccl")
        )
        batch = megatron_scale._batch(8, 4096, config.vocab_size, ragged=True)
        batch.log_probs = be.compute_log_probs(batch) * batch.response_mask
        algo = AlgoConfig()
        for _ in range(2):  # warm-up: compiled kernels for every length
            be.train(batch, algo)
        torch.cuda.synchronize()
        start = time.perf_counter()
        be.train(batch, algo)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            be.train(batch, algo)
            torch.cuda.synchronize()
        print(f"===== packing={packing} wall {wall:.3f} s")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=60))
        destroy_parallel_state()
        del be
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
