"""The megatron backend ticks its progress counter once per micro-batch, as the torch backend does: the stall
deadline (tasks/progress.py, flows/stall_watch.py) reads it while a train or scoring call runs, on both of the
backend's paths (rollflow's micro-batch loop, optimizer='torch'; Megatron's schedule, optimizer='megatron'),
on CPU through the test-only shims."""

from __future__ import annotations

import pytest

from tests.test_megatron_parallel import HAVE_MEGATRON, LR, N_SAMPLES, _algo, _reference

pytestmark = pytest.mark.skipif(not HAVE_MEGATRON, reason="needs megatron-core (pip install 'rollflow[megatron]')")


@pytest.mark.parametrize("optimizer", ["torch", "megatron"])
def test_train_and_scoring_tick_once_per_micro_batch(optimizer):
    from rollflow.tasks.progress import ReportsProgress, progress_of
    from rollflow.tasks.train.megatron.backend import MegatronBackend
    from rollflow.tasks.train.megatron.process import destroy_parallel_state
    from rollflow.tasks.train.settings import OptimConfig
    from tests.megatron_cpu_shim import cpu_megatron

    ref = _reference("llama")
    steps, micro = 2, 2  # 8 rows: 2 mini-batches of 4 rows, 2 micro-batches each
    optim = OptimConfig(
        backend="megatron",
        device="cpu",
        dtype="float32",
        lr=LR,
        num_steps_per_rollout=steps,
        micro_batch_size=micro,
        megatron={"layer_spec": "sdpa", "optimizer": optimizer},
    )
    with cpu_megatron():
        be = MegatronBackend(ref["config"], ref["state"], optim, keep_ref=False)
        try:
            # the declared capability the trainer worker sums (tasks/train/worker.py: progress_of(backend))
            assert isinstance(be, ReportsProgress) and progress_of(be) == 0
            after_step: list[int] = []
            be.train(ref["batch"], _algo(), on_step=lambda _stats: after_step.append(progress_of(be)))
            trained = progress_of(be)
            be.compute_log_probs(ref["batch"])
            scored = progress_of(be) - trained
        finally:
            destroy_parallel_state()
    per_step = N_SAMPLES // steps // micro
    assert after_step == [per_step, 2 * per_step]  # ticks while the call runs, not once at its end
    assert trained == N_SAMPLES // micro
    assert scored == N_SAMPLES // micro
