"""rollflow benchmarks: `python -m benchmarks [--suite NAME ...] [--quick] [--out FILE]` (issue 11).

Suites (each figure is min / median / max over repeats; every ratio is measured within one run):
1. orchestration  rl_train (Prefect + Ray + artifacts) vs the bare Python loop, two iteration sizes
2. artifact_io    RolloutStore write/read vs raw fsspec bytes, file:// and loopback S3 (moto)
3. rollout        engines' tokens/s vs plain `model.generate` with the dynamic cache
4. train          train tokens/s per backend (MFU on GPU)
5. sync           trainer -> engine weight sync bytes/s per path vs a plain copy
6. replay         `rollflow replay` start -> first train step vs one iteration
7-9.              async pipeline, watchdog cost, cluster (see each suite's module)
10. e2e           one whole RL iteration per stage, rollout + train workers colocated in one process
                  (`--shape`; scripts/e2e_gpu.sh runs three shapes on a CUDA GPU)

Suites 3-5 and 10 import torch / transformers / tasks only, so they run on a GPU box without Prefect or Ray.

Standalone: `python -m benchmarks.ppo_value_loss` (PPO's critic value loss at a shape, in one process;
scripts/ppo_gpu.sh runs it at 0.5B on a CUDA GPU).
"""
