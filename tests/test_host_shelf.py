"""The pinned host shelf that offload and the engine's release park state on (rollflow.tasks.pinned.HostShelf)."""

from __future__ import annotations

import gc

import pytest
import torch

from rollflow.tasks.pinned import HostShelf, page_locked, park_on_host


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(7, 5, generator=g).to(torch.bfloat16),  # 70 bytes: not a page
        "m": torch.randn(3000, generator=g),  # 12,000 bytes: three pages
        "step": torch.tensor(4, dtype=torch.int64),  # a 0-d tensor
        "none": torch.empty(0, 9),  # no bytes at all
    }


def test_buffers_match_shape_and_dtype_and_hold_what_is_copied_in():
    shelf = HostShelf(pin=False)
    src = _tensors()
    bufs = shelf.place(src)
    assert list(bufs) == list(src)
    for k, t in src.items():
        assert bufs[k].shape == t.shape and bufs[k].dtype == t.dtype
        bufs[k].copy_(t)
    for k, t in src.items():  # written one after another: no buffer overlaps another
        assert torch.equal(bufs[k], t), k


def test_one_allocation_of_exactly_the_pages_needed_per_batch_and_reuse_after():
    shelf = HostShelf(pin=False)
    src = _tensors()
    shelf.place(src)
    # 70 B -> 1 page, 12,000 B -> 3 pages, 8 B -> 1 page, 0 B -> none (4096-byte pages)
    assert len(shelf.blocks) == 1 and shelf.nbytes() == 5 * 4096
    again = shelf.place(src)
    assert len(shelf.blocks) == 1  # same keys, shapes, dtypes: the same buffers
    assert all(again[k].data_ptr() == shelf.slots[k].data_ptr() for k in src)
    first_w = again["w"].data_ptr()
    grown = shelf.place({**src, "w": torch.zeros(7, 6, dtype=torch.bfloat16), "adam": torch.zeros(100)})
    assert len(shelf.blocks) == 2 and shelf.nbytes() == 5 * 4096 + 2 * 4096  # only the new and the changed
    assert grown["w"].shape == (7, 6) and grown["w"].data_ptr() != first_w
    assert grown["m"].data_ptr() == again["m"].data_ptr()
    # Every buffer starts on its own page: views of any dtype are aligned and no two share a page.
    assert all(b.data_ptr() % 4096 == 0 for k, b in grown.items() if b.numel())


def test_a_changed_dtype_gets_a_new_buffer():
    shelf = HostShelf(pin=False)
    a = shelf.place({"x": torch.zeros(16, dtype=torch.float32)})["x"]
    b = shelf.place({"x": torch.zeros(16, dtype=torch.bfloat16)})["x"]
    assert b.dtype == torch.bfloat16 and a.data_ptr() != b.data_ptr()


def cuda(test):
    needs = pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locking needs a CUDA device")
    return pytest.mark.gpu(needs(test))


@cuda
def test_pinned_buffers_are_page_locked_and_round_trip_asynchronously():
    # the driver's answer, checked on what torch's own allocator pins and on plain memory
    assert page_locked(torch.empty(1 << 20, pin_memory=True)) and not page_locked(torch.ones(1 << 20))
    shelf = HostShelf()
    src = {k: t.cuda() for k, t in _tensors().items()}
    bufs = shelf.place(src)
    assert all(page_locked(b) for b in bufs.values() if b.numel())
    for k, t in src.items():
        bufs[k].copy_(t, non_blocking=True)
    torch.cuda.synchronize()
    back = {k: b.to("cuda", non_blocking=True) for k, b in bufs.items()}
    torch.cuda.synchronize()
    assert all(torch.equal(back[k], src[k]) for k in src)


@cuda
def test_a_dropped_shelf_unregisters_its_memory():
    shelf = HostShelf()
    view = shelf.place({"x": torch.zeros(1 << 20)})["x"]
    assert page_locked(view)
    del shelf
    gc.collect()
    assert not page_locked(view)  # the view keeps the memory, which is no longer locked (so it can be freed)


@cuda
def test_park_on_host_reuses_the_shelf_between_parks():
    model = torch.nn.Linear(64, 32).cuda()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    shelf = HostShelf()
    park_on_host(model, shelf)
    ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    assert all(p.device.type == "cpu" and page_locked(p) for p in model.parameters())
    for p in model.parameters():
        p.data = p.data.cuda()
    park_on_host(model, shelf)
    assert len(shelf.blocks) == 1 and {k: v.data_ptr() for k, v in model.state_dict().items()} == ptrs
    assert all(torch.equal(v.cuda(), want[k]) for k, v in model.state_dict().items())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a host without CUDA gets")
def test_the_allocation_probe_refuses_in_one_line_without_cuda(capsys, tmp_path):
    from benchmarks import pinned_host_alloc

    assert pinned_host_alloc.main(["--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs a CUDA device" in err and "\n" not in err and not (tmp_path / "x.json").exists()
