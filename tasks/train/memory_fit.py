"""Will the trainer's state fit? Checked by the train worker before it loads a weight, so a model too big for
its GPU (or, with colocated offload, for the node's host memory) is refused in one line naming the fix instead of
running out of memory at the first optimizer step (Adam allocates its moments lazily) or at the first offload.

The figure is a lower bound: the bytes per parameter of the state the backend keeps whatever the batch
(weights, gradients, optimizer state; docs/megatron.md "What fits on one H200" has the measured peaks, which
add activations and the optimizer step's working set on top), times the parameters this rank holds at least
(the model's count divided over tensor and pipeline ranks). So a refusal is certain, never a guess; a config
that passes can still run out of memory on activations.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollflow.tasks.train.settings import OptimConfig

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


class TrainerDoesNotFit(MemoryError):
    """The trainer's state cannot fit where it must live; the message names the field to change."""


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of one rank's persistent training state, by part, and which parts live on the host
    while a colocated engine generates (gradients are dropped then: every train call starts from zero)."""

    weights: float
    grads: float
    optimizer: float
    reference: float  # a frozen copy of the starting weights (the KL reference)
    reference_on_gpu: bool
    parts: str  # the breakdown in words, for the refusal

    @property
    def gpu(self) -> float:
        return self.weights + self.grads + self.optimizer + (self.reference if self.reference_on_gpu else 0.0)

    @property
    def parked(self) -> float:
        """What offload moves to host memory, plus a reference kept there throughout."""
        return self.weights + self.optimizer + self.reference


def megatron_state(dtype: str, optimizer: str, dp: int, distributed_optimizer: bool) -> StateBytes:
    """Megatron's DDP keeps fp32 main grads (grad_reduce_in_fp32); its mixed-precision optimizer fp32 masters
    plus Adam m and v (sharded over data parallel with the distributed optimizer). optimizer='torch' is
    tasks/train/megatron/optimizer.py's MasterAdamW: grads in the param dtype, fp32 masters, m and v. The reference
    is a host copy (tasks/train/megatron/backend.py)."""
    w = DTYPE_BYTES[dtype]
    master = 4 if w != 4 else 0
    if optimizer == "torch":
        return StateBytes(
            w, w, master + 8, w, False, f"{dtype} weights {w}, grads {w}, fp32 master + Adam m, v {master + 8}"
        )
    shard = dp if distributed_optimizer else 1
    opt = (master + 8) / shard
    sharded = f" / {shard} data-parallel ranks" if shard > 1 else ""
    return StateBytes(
        w, 4, opt, w, False, f"{dtype} weights {w}, fp32 main grads 4, fp32 master + Adam m, v {master + 8}{sharded}"
    )


def torch_state(dtype: str, lora: bool) -> StateBytes:
    """The torch backend: AdamW's m and v in the param dtype, a reference model beside the policy on the same
    device. With LoRA only the adapter trains (its state is counted as nothing) and the frozen base is the
    reference."""
    w = DTYPE_BYTES[dtype]
    if lora:
        return StateBytes(w, 0, 0, 0, True, f"{dtype} frozen base weights {w} (the adapter's state is not counted)")
    return StateBytes(w, w, 2 * w, w, True, f"{dtype} weights {w}, grads {w}, Adam m, v {2 * w}, reference {w}")


def safetensors_params(model_dir: str | Path) -> int:
    """Parameters of the checkpoint in `model_dir`, from the safetensors headers alone: each file starts with the
    header's length (8 bytes, little-endian) and a JSON header of every tensor's shape. Read directly rather than
    through `safetensors.safe_open`, which maps the whole file first (refused by the kernel for files larger than
    it will map, the very models this check is for)."""
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                total += math.prod(entry["shape"])
    return total


def engine_host_bytes_per_param(engine: str, dtype: str) -> float:
    """Host memory one engine keeps while a trainer beside it trains, per model parameter: an `hf` engine's
    weights in its dtype (parked on a pinned host shelf when colocated on a GPU, living there on CPU); SGLang's
    memory saver frees released weights (0)."""
    return float(DTYPE_BYTES[dtype]) if engine == "hf" else 0.0


def host_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable of this node (None where the kernel does not say)."""
    try:
        text = Path(meminfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def fit_refusal(
    params: int,
    ranks_sharing: int,
    state: StateBytes,
    *,
    device: str,
    gpu_bytes: int | None,
    gpu_name: str = "the GPU",
    host_bytes: int | None,
    parks_on_host: bool,
    node_ranks: int = 1,
    engine_host_bytes_per_param: float = 0.0,
) -> str | None:
    """Why this rank's state cannot fit, or None. `params`: the model's; `ranks_sharing`: tensor x pipeline
    ranks it is divided over; `gpu_bytes`: the device's total memory (CUDA); `host_bytes`: memory available on
    the node; `parks_on_host`: colocated offload (placement=colocate, offload=true); `node_ranks`: trainer
    ranks on this node, each keeping as much in its host memory (checked before any of them loads, so each
    sees the same MemAvailable); `engine_host_bytes_per_param`: what the engines of this node keep in its host
    memory while the trainer runs, per model parameter (all of them together: the `hf` engine's weights, parked
    on a host shelf when colocated, or living there on CPU)."""
    per_rank = params / ranks_sharing
    who = f"{per_rank / 1e9:.2f}B parameters" + (
        f" on each of {ranks_sharing} tensor x pipeline ranks" if ranks_sharing > 1 else ""
    )
    on_node = f" x {node_ranks} trainer ranks on this node" if node_ranks > 1 else ""
    engines = params * engine_host_bytes_per_param
    beside = f" + {_gib(engines)} of the engines' weights on this node" if engines else ""
    shard_fix = (
        "spread the model over more GPUs (train.megatron.tp / pp, or resources.trainer_gpus with "
        "train.megatron.use_distributed_optimizer=true) or train adapters only (model.lora)"
    )
    if device.startswith("cuda"):
        need = per_rank * state.gpu
        if gpu_bytes is not None and need > gpu_bytes:
            return (
                f"train: the trainer's state does not fit {gpu_name}: {who} x {state.gpu:g} B ({state.parts}) = "
                f"{_gib(need)} at least, the GPU has {_gib(gpu_bytes)}: {shard_fix}"
            )
        if parks_on_host:
            need = per_rank * state.parked * node_ranks + engines
            if host_bytes is not None and need > host_bytes:
                return (
                    f"offload: the trainer parks {_gib(need)} at least in host memory while the engine generates "
                    f"({who} x {state.parked:g} B{on_node}: weights, optimizer state and reference; grads are "
                    f"dropped{beside}), "
                    f"this node has {_gib(host_bytes)} available: set offload=false (the state stays on the GPU), "
                    f"or {shard_fix}"
                )
        return None
    need = per_rank * state.gpu * node_ranks + engines  # on CPU every part lives in host memory
    if host_bytes is not None and need > host_bytes:
        return (
            f"train: the trainer's state does not fit this node's memory: {who} x {state.gpu:g} B ({state.parts})"
            f"{on_node}{beside} = "
            f"{_gib(need)} at least, {_gib(host_bytes)} available: train on a GPU (train.device=cuda) or "
            "a smaller model (model.path)"
        )
    return None


def trainer_state(optim: OptimConfig, world: int, lora: bool) -> tuple[StateBytes, int]:
    """(bytes per parameter, tensor x pipeline ranks sharing the model) of `optim` (train.*) on `world` ranks."""
    if optim.backend != "megatron":
        return torch_state(optim.dtype, lora), 1
    m = optim.megatron
    model_parallel = m.tp * m.pp
    optimizer = m.optimizer
    if optimizer == "auto":  # as the megatron backend resolves it
        optimizer = "megatron" if str(optim.device).startswith("cuda") else "torch"
    dp = max(1, world // (model_parallel * m.cp))
    return megatron_state(optim.dtype, optimizer, dp, m.use_distributed_optimizer), model_parallel


def check_trainer_fits(
    params: int,
    optim: OptimConfig,
    *,
    world: int = 1,
    lora: bool = False,
    parks_on_host: bool,
    node_ranks: int = 1,
    engine_host_bytes_per_param: float = 0.0,
) -> None:
    """Raise `TrainerDoesNotFit` when this rank's state cannot fit this machine (`fit_refusal`), before anything
    is loaded. `params`: the model's (`safetensors_params`); `optim`: train.*; `parks_on_host`: colocated
    offload; `node_ranks`: trainer ranks on this node (their host-side state adds up);
    `engine_host_bytes_per_param`: the host memory this node's engines keep beside it (`fit_refusal`)."""
    import torch

    state, sharing = trainer_state(optim, world, lora)
    gpu_bytes, gpu_name = None, "the GPU"
    if str(optim.device).startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(optim.device))
        gpu_bytes, gpu_name = props.total_memory, props.name
    why = fit_refusal(
        params,
        sharing,
        state,
        device=str(optim.device),
        gpu_bytes=gpu_bytes,
        gpu_name=gpu_name,
        host_bytes=host_available_bytes(),
        parks_on_host=parks_on_host,
        node_ranks=node_ranks,
        engine_host_bytes_per_param=engine_host_bytes_per_param,
    )
    if why:
        raise TrainerDoesNotFit(why)
