"""tasks/sync/copy_plan.py: a weight update's copies planned once, replayed (on one GPU, as a CUDA graph)
while the same sources sit at the same addresses, and re-planned when anything moves."""

from __future__ import annotations

import pytest
import torch

from rollflow.tasks.sync.copy_plan import CopyPlan, plan_key, run_plan

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _pairs(device: str, dtype=torch.float32) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shapes = [(3 << 20,), (64, 8), (5,), (1 << 20, 4)]  # two above the 8 MB memcpy threshold in fp32
    dst = [torch.zeros(s, dtype=dtype, device=device) for s in shapes]
    src = [torch.randn(s, device=device) for s in shapes]
    return dst, src


def test_key_changes_with_any_moved_or_reshaped_source_and_any_moved_destination():
    dst, src = _pairs("cpu")
    key = plan_key(dst, src)
    assert plan_key(dst, src) == key
    assert plan_key(dst, [*src[:-1], src[-1].clone()]) != key  # same shape, new memory
    assert plan_key(dst, [*src[:-1], src[-1].view(4, 1 << 20)]) != key  # same memory, new shape
    assert plan_key(dst, [*src[:-1], src[-1].view(torch.int32)]) != key  # same memory, new dtype
    assert plan_key([*dst[:-1], dst[-1].clone()], src) != key


def test_eager_plan_copies_the_kept_pairs_only_and_reads_current_contents():
    dst, src = _pairs("cpu")
    plan = CopyPlan(plan_key(dst, src), keep=(0, 1, 3))
    for _ in range(3):  # the second run is where a GPU plan is captured: on CPU it stays eager
        for s in src:
            s.normal_()
        run_plan(plan, dst, src)
        for i in (0, 1, 3):
            assert torch.equal(dst[i], src[i])
        assert not dst[2].any()
    assert plan.graph is False


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["same-dtype", "cast"])
def test_graph_replay_copies_what_the_sources_hold_now(dtype):
    dst, src = _pairs("cuda", dtype)
    plan = CopyPlan(plan_key(dst, src), keep=(0, 1, 2, 3))
    for step in range(4):
        for s in src:
            s.normal_()  # in place: same addresses, new values (what an optimizer step does)
        run_plan(plan, dst, src)
        torch.cuda.synchronize()
        for d, s in zip(dst, src):
            assert torch.equal(d, s.to(dtype)), step
    assert plan.graph, "the plan was not captured as a CUDA graph"
