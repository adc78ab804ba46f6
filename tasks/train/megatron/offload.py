"""Colocated placement: a Megatron rank's weights, main grads and optimizer state to pinned host memory while
the engine generates, and back bit for bit.

Megatron's own `optimizer.offload_to_cpu` is not used: it moves the optimizer's params by `p.data =
p.data.cpu()`, which reads freed storage when they are views into DDP's param buffer (distributed optimizer:
'CUDA error: invalid argument' on the H200) and, for fp32 params, breaks that aliasing. Here every tensor is
moved once, by what owns its storage: DDP buffers resize their own storage (views stay valid), other
parameters and the optimizer's own tensors (Adam state, fp32 masters) are copied to pinned host memory and
their device storage released. Every host copy, DDP's included, lives on the caller's `HostShelf`: exact sizes,
page-locked once (the first offload of a fresh process), reused by every later one.
"""

from __future__ import annotations

import torch

from rollflow.tasks.pinned import HostShelf

HostCopy = dict[tuple, torch.Tensor]


def offload_to_host(
    chunks: list[torch.nn.Module], ddps: list, inners: list, device: torch.device, shelf: HostShelf
) -> tuple[HostCopy, HostCopy]:
    """Move `chunks` (wrapped by Megatron's `ddps`) and the state of the torch optimizers `inners` to the host,
    into buffers of `shelf`: (host copies by key, the optimizer's own params whose device storage was released).
    CUDA only."""
    torch.cuda.synchronize()
    buffers = [b for ddp in ddps for b in ddp.buffers + list(getattr(ddp, "expert_parallel_buffers", []))]
    owned = {
        t.untyped_storage().data_ptr()
        for b in buffers
        for t in (b.param_data, b.grad_data)
        if t is not None and t.untyped_storage().size() > 0
    }
    moving: dict[tuple, torch.Tensor] = {}  # what gets a host copy, by key
    params = {(i, name): param for i, chunk in enumerate(chunks) for name, param in chunk.named_parameters()}
    for key, param in params.items():  # parameters outside DDP's param buffer
        if param.is_cuda and param.untyped_storage().data_ptr() not in owned:
            moving[("param",) + key] = param.data
    model_storages = {p.untyped_storage().data_ptr() for p in params.values()} | owned
    extra: dict[tuple, torch.Tensor] = {}  # optimizer params that are its own tensors (fp32 masters)
    for o, inner in enumerate(inners):
        for g, group in enumerate(inner.param_groups):
            for j, p in enumerate(group["params"]):
                if p.is_cuda and p.untyped_storage().data_ptr() not in model_storages:
                    moving[("opt_param", o, g, j)] = p.data
                    extra[("opt_param", o, g, j)] = p
        for j, state in enumerate(inner.state.values()):
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.is_cuda:
                    moving[("opt_state", o, j, k)] = v
    # DDP's param buffer copies itself into `param_data_cpu` when it has one, else into a fresh pinned tensor of
    # torch's allocator: it gets a shelf buffer like the rest.
    held = {
        ("ddp_param", n): b.param_data
        for n, b in enumerate(buffers)
        if b.param_data is not None and b.param_data.untyped_storage().size() > 0
    }
    bufs = shelf.place({**moving, **held})
    for key, tensor in moving.items():
        bufs[key].copy_(tensor, non_blocking=True)
    host = {key: bufs[key] for key in moving}
    for key in held:
        buffers[key[1]].param_data_cpu = bufs[key]
    torch.cuda.synchronize()
    for b in buffers:  # grad buffers, and the param buffer of the distributed optimizer
        b.offload_to_cpu(move_params=True, move_grads=True)
    for key, param in params.items():
        if ("param",) + key in host:
            param.data = torch.empty(0, dtype=param.dtype, device=device)
    for p in extra.values():
        p.data = torch.empty(0, dtype=p.dtype, device=device)
    for o, inner in enumerate(inners):
        for j, state in enumerate(inner.state.values()):
            for k in list(state):
                if ("opt_state", o, j, k) in host:
                    state[k] = host[("opt_state", o, j, k)]
    torch.cuda.empty_cache()
    return host, extra


def onload_from_host(
    chunks: list[torch.nn.Module], ddps: list, inners: list, host: HostCopy, extra: HostCopy, device: torch.device
) -> None:
    """Undo `offload_to_host`: weights, (zeroed) grad buffers and optimizer state back on `device`."""
    for ddp in ddps:
        for buffer in ddp.buffers + list(getattr(ddp, "expert_parallel_buffers", [])):
            buffer.reload_from_cpu(move_params=True, move_grads=True)
    for i, chunk in enumerate(chunks):
        for name, param in chunk.named_parameters():
            if ("param", i, name) in host:
                param.data = host[("param", i, name)].to(device, non_blocking=True)
    for key, p in extra.items():
        p.data = host[key].to(device, non_blocking=True)
    for o, inner in enumerate(inners):
        for j, state in enumerate(inner.state.values()):
            for k in list(state):
                if ("opt_state", o, j, k) in host:
                    state[k] = host[("opt_state", o, j, k)].to(device, non_blocking=True)
    torch.cuda.synchronize()
