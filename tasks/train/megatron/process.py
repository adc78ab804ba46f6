"""megatron-core in this process: whether it (and Transformer Engine) is installed, torch.distributed with
Megatron's parallel groups, and the CPU shims that let the sdpa layer spec run without a GPU.

megatron-core is imported on use only: this module imports on a CPU box without it, and `require_megatron`
raises `MegatronMissing` with the install line.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from rollflow.tasks.net import free_port
from rollflow.tasks.train.data_parallel import DataParallel
from rollflow.tasks.train.settings import MegatronSettings

MISSING_MESSAGE = (
    "train.backend='megatron' needs megatron-core: pip install 'rollflow[megatron]' "
    "(Python >= 3.12 for megatron-core >= 0.17; 0.16.1 on 3.11)"
)


class MegatronMissing(ImportError):
    pass


def require_megatron():
    try:
        import megatron.core
    except ImportError as exc:
        raise MegatronMissing(MISSING_MESSAGE) from exc
    return megatron.core


def megatron_version() -> str | None:
    try:
        from megatron.core.package_info import __version__
    except ImportError:
        return None
    return __version__


def have_transformer_engine() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install raising at import
        return False
    return True


@contextlib.contextmanager
def cpu_shims(device: torch.device):
    """On CPU, point megatron-core's hard-coded `torch.cuda.current_device()` (rotary cache, buffers) at the
    CPU while inside. A no-op on CUDA. Only the sdpa layer spec and the torch optimizer run on CPU."""
    if device.type == "cuda":
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = original


def init_parallel_state(
    device: torch.device, seed: int, *, settings: MegatronSettings | None = None, dp: DataParallel | None = None
) -> None:
    """torch.distributed (this rank's place from `dp`; one process without it) + Megatron's parallel groups
    (tp / pp / cp from `settings`, data parallel = world / (tp * pp * cp)). Idempotent."""
    from megatron.core import parallel_state, tensor_parallel  # optional dependency: imported on use

    settings = settings or MegatronSettings()
    if device.type == "cuda":
        torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if dp is not None:
            dist.init_process_group(backend=backend, init_method=dp.init_method, rank=dp.rank, world_size=dp.world_size)
        elif int(os.environ.get("WORLD_SIZE", 1)) > 1:  # launched by torchrun: its env rendezvous
            dist.init_process_group(backend=backend)
        else:
            # One process: a fresh port every time. A MASTER_PORT inherited from the environment (e.g. set by an
            # earlier backend in the process that started this one) may be in use by now.
            dist.init_process_group(
                backend=backend, init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}", rank=0, world_size=1
            )
    settings.data_parallel_size(dist.get_world_size())  # one clear error before any group is built
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=settings.tp,
            pipeline_model_parallel_size=settings.pp,
            virtual_pipeline_model_parallel_size=settings.vpp,
            context_parallel_size=settings.cp,
        )
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_parallel_state() -> None:
    """Undo `init_parallel_state` (Megatron's groups, then the default group)."""
    from megatron.core import parallel_state  # optional dependency: imported on use

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
