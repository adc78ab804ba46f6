"""Test-only shims that let megatron-core's CUDA-hard-coded paths run on CPU with gloo (0.16.1 on Python 3.11,
0.19.2 on 3.12).

Megatron's DDP grad buffers, schedules, p2p communication, optimizer and grad clipping create small
tensors with `device="cuda"` / `torch.cuda.current_device()` and call `torch.cuda.synchronize()`. Inside
`cpu_megatron()` those go to the CPU instead. Used only by the spawned processes of the CPU tests; the
product code never patches torch.
"""

from __future__ import annotations

import contextlib
import functools

import torch

_FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange")


def _to_cpu_device(device):
    if device is None:
        return None
    if (
        isinstance(device, int)
        or (isinstance(device, str) and device.startswith("cuda"))
        or (isinstance(device, torch.device) and device.type == "cuda")
    ):
        return torch.device("cpu")
    return device


class _NoStream:
    """The CPU's stand-in for a CUDA stream: CPU ops are synchronous, so every wait is already satisfied."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


@contextlib.contextmanager
def cpu_megatron():
    originals = {name: getattr(torch, name) for name in _FACTORIES}
    saved_cuda = (
        torch.cuda.current_device,
        torch.cuda.synchronize,
        torch.Tensor.cuda,
        torch.Tensor.type,
        torch.cuda.current_stream,
    )
    tensor_type = torch.Tensor.type

    def cuda_type_name(self, *args, **kwargs):
        # Megatron asserts grads are 'torch.cuda.FloatTensor' before clipping: name CPU tensors the CUDA way.
        if args or kwargs:
            return tensor_type(self, *args, **kwargs)
        name = tensor_type(self)
        return name.replace("torch.", "torch.cuda.", 1) if not self.is_cuda else name

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _to_cpu_device(kwargs["device"])
            kwargs.pop("pin_memory", None)  # context parallel's RoPE slice stages its index in pinned memory
            return fn(*args, **kwargs)

        return inner

    for name, fn in originals.items():
        setattr(torch, name, wrap(fn))
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    # 0.19's grad sync waits on the current CUDA stream for CUDA-graph replays: on CPU there is nothing to wait for
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.type = cuda_type_name
    # Activation recompute saves / restores the CUDA RNG state around the recomputed forward: the CPU
    # generator (which Megatron saves and restores itself as well) stands in.
    from megatron.core.tensor_parallel import random as mp_random

    saved_rng = (mp_random._get_cuda_rng_state, mp_random._set_cuda_rng_state)
    mp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda *a, **k: None
    # Sequence parallelism forks the model-parallel CUDA RNG around the embedding's dropout (0 here); the
    # tracker's states are CUDA generators, which a CPU run has none of.
    saved_fork = mp_random.CudaRNGStatesTracker.fork
    mp_random.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch, name, fn)
        (
            torch.cuda.current_device,
            torch.cuda.synchronize,
            torch.Tensor.cuda,
            torch.Tensor.type,
            torch.cuda.current_stream,
        ) = saved_cuda
        mp_random._get_cuda_rng_state, mp_random._set_cuda_rng_state = saved_rng
        mp_random.CudaRNGStatesTracker.fork = saved_fork
