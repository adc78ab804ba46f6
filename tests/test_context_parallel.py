"""Context parallel layout (tasks/train/megatron/context_parallel.py): Megatron's zigzag chunks, the gather order,
and the two-chunk causal attention against plain causal SDPA over the whole sequence. Multi-rank equality with one rank
(loss, grads, log-probs) is in tests/test_megatron_parallel.py (cp2 layouts)."""

from __future__ import annotations

import pytest
import torch

from rollflow.tasks.train.megatron import context_parallel as cpl


def test_zigzag_chunks_are_megatrons():
    # 16 tokens, cp=2: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 (Megatron's
    # get_batch_on_this_cp_rank / get_pos_emb_on_this_cp_rank layout)
    assert cpl.zigzag_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cpl.zigzag_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert cpl.zigzag_positions(12, 3, 2).tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="not a multiple of 2 x cp = 4"):
        cpl.zigzag_positions(10, 2, 0)


def test_packed_rows_are_split_row_by_row_and_gathered_back_in_order():
    bounds = (0, 8, 12, 24)  # three rows of 8, 4 and 12 tokens (each a multiple of 2 x cp)
    by_rank = [cpl.packed_zigzag_positions(bounds, 2, r) for r in range(2)]
    assert by_rank[0].tolist() == [0, 1, 6, 7, 8, 11, 12, 13, 14, 21, 22, 23]
    assert cpl.local_bounds(bounds, 2) == (0, 4, 6, 12)
    sequence = torch.arange(100, 124)
    laid_end_to_end = torch.cat([sequence[p] for p in by_rank])
    assert torch.equal(laid_end_to_end[cpl.gather_order(by_rank)], sequence)


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_chunk_attention_equals_causal_attention_over_the_whole_sequence(cp):
    g = torch.Generator().manual_seed(0)
    length = 2 * cp * 5
    q, k, v = (torch.randn(2, 3, length, 8, generator=g, dtype=torch.float64) for _ in range(3))
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def attend(q_, k_, v_, mask):
        return torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask)

    for rank in range(cp):
        mine = cpl.zigzag_positions(length, cp, rank)
        got = cpl.chunk_attention(attend, q[:, :, mine], k, v, cp=cp, rank=rank)
        torch.testing.assert_close(got, whole[:, :, mine], rtol=0, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chunk_attention_on_cuda_in_bf16():
    """The lower-right causal mask goes to torch's CUDA kernels: the same as whole-sequence causal attention to
    bf16 round-off."""
    g = torch.Generator(device="cuda").manual_seed(0)
    cp, length = 4, 8 * 256
    q, k, v = (torch.randn(1, 8, length, 64, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def attend(q_, k_, v_, mask):
        return torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask)

    for rank in range(cp):
        mine = cpl.zigzag_positions(length, cp, rank).cuda()
        got = cpl.chunk_attention(attend, q[:, :, mine], k, v, cp=cp, rank=rank)
        torch.testing.assert_close(got.float(), whole[:, :, mine].float(), rtol=0, atol=2e-2)
