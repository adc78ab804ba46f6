"""Data parallelism of the `torch` backend: one process per rank, gradients summed with torch.distributed.

How a step stays equal to the single-rank step:

- every rank holds the WHOLE prepared TrainBatch: old/ref log-probs and advantages are computed over
  all rows before anything is split, so a GRPO group may be split across ranks freely;
- every optimizer step uses the single-rank mini-batch (`objective.minibatch_slices`); each rank trains
  on a contiguous share of that mini-batch's rows (`shard_rows`);
- the loss is normalised by the mini-batch's GLOBAL token / row counts (`Denominators.of` on the whole
  mini-batch, which every rank holds, so no collective is needed for them), hence the ranks' losses add
  up to the single-rank loss and the gradients are all-reduced with SUM, not averaged, before clipping;
- statistics are this rank's share of the mini-batch mean, so they are summed across ranks too.

World size 1 builds no process group at all: the single-rank code path runs unchanged.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
# Gradients travel in flat buckets of about this size: few collectives, bounded extra memory.
GRAD_BUCKET_BYTES = 32 * 2**20
# Collectives also wait this long for a slow rank (e.g. rank 0 writing a checkpoint while the others
# already wait in the next train call), so it is generous; torch's own default is 30 minutes too.
DEFAULT_TIMEOUT_S = 1800.0


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """Where this process sits in the data-parallel trainer group (one TrainWorker per rank)."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    backend: str = "gloo"  # gloo on CPU, nccl on GPUs

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"DataParallel.world_size={self.world_size} must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"DataParallel.rank={self.rank} must be in [0, world_size={self.world_size})")
        if not self.master_addr:
            raise ValueError("DataParallel.master_addr is empty: give rank 0's host address")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"DataParallel.master_port={self.master_port} must be in 1..65535")
        if self.backend not in BACKENDS:
            raise ValueError(f"DataParallel.backend={self.backend!r} must be one of {BACKENDS}")

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_primary(self) -> bool:
        """Rank 0: the one rank that writes checkpoints, states and dumps."""
        return self.rank == 0

    @property
    def init_method(self) -> str:
        host = self.master_addr
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # an IPv6 literal
        return f"tcp://{host}:{self.master_port}"


def init_data_parallel(dp: DataParallel, timeout_s: float = DEFAULT_TIMEOUT_S):
    """The process group of `dp` (the default group), or None for world_size 1 (no collectives at all).

    Blocks until all `world_size` ranks have joined. A default group that already exists in this
    process (e.g. a restarted backend in the same actor) is reused when it is the same world.
    """
    if not dp.enabled:
        return None
    if dist.is_initialized():
        have = (dist.get_rank(), dist.get_world_size(), dist.get_backend())
        if have != (dp.rank, dp.world_size, dp.backend):
            raise RuntimeError(
                f"this process already has a torch.distributed group (rank, world_size, backend)={have}, "
                f"but DataParallel asks for {(dp.rank, dp.world_size, dp.backend)}; one trainer group per process"
            )
        return dist.group.WORLD
    dist.init_process_group(
        backend=dp.backend,
        init_method=dp.init_method,
        rank=dp.rank,
        world_size=dp.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return dist.group.WORLD


def destroy_data_parallel() -> None:
    """Leave the default group (tests, actor shutdown); a no-op when there is none."""
    if dist.is_initialized():
        dist.destroy_process_group()


def shard_rows(n_rows: int, rank: int, world: int) -> slice:
    """This rank's contiguous rows of an `n_rows` mini-batch.

    Uneven on purpose: sizes differ by at most one row, and a rank may get none (fewer rows than
    ranks). The loss is normalised by the whole mini-batch's counts, so uneven shares leave the summed
    gradient exact; padding would add dead rows of compute, and refusing batch sizes not divisible by
    world * steps would reject ordinary configs (64 samples, 3 steps). Every rank still runs the same
    optimizer steps, because the mini-batches are the single-rank ones.
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank={rank} must be in [0, world={world})")
    if n_rows < 0:
        raise ValueError(f"n_rows={n_rows} must be >= 0")
    base, extra = divmod(n_rows, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def _collective_device(group) -> torch.device:
    # NCCL only moves CUDA tensors; gloo takes CPU ones.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sum_stats(stats: dict[str, float], group, names: Sequence[str]) -> dict[str, float]:
    """Sum every rank's share of the statistics; keys are those any rank reported, in `names` order.

    A fixed key list: a rank with no rows in a mini-batch reports nothing, yet must join the same
    collective with the same tensor shape.
    """
    unknown = sorted(set(stats) - set(names))
    if unknown:
        raise ValueError(f"statistics {unknown} have no slot in the data-parallel reduction; add them to {names}")
    values = [float(stats.get(k, 0.0)) for k in names] + [float(k in stats) for k in names]
    total = torch.tensor(values, dtype=torch.float64, device=_collective_device(group))
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    out = total.tolist()
    n = len(names)
    return {k: out[i] for i, k in enumerate(names) if out[n + i] > 0}


def _buckets(tensors: list[torch.Tensor], cap_bytes: int) -> Iterable[list[torch.Tensor]]:
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > cap_bytes or t.dtype != bucket[0].dtype or t.device != bucket[0].device):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def all_reduce_grads(params: Iterable[torch.nn.Parameter], group, bucket_bytes: int = GRAD_BUCKET_BYTES) -> None:
    """Sum the gradients of all ranks in place (SUM: each rank's loss already carries the global
    denominators). Afterwards every rank holds the same gradients, so clipping and the optimizer step
    are the same everywhere."""
    params = [p for p in params if p.requires_grad]
    # A rank that had no rows in this mini-batch has no grads (set_to_none); which parameters got a
    # gradient anywhere decides both the collective shapes and which stay None, as on one rank.
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=_collective_device(group))
    dist.all_reduce(has, op=dist.ReduceOp.SUM, group=group)
    grads = []
    for p, count in zip(params, has.tolist()):
        if count == 0:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    for bucket in _buckets(grads, bucket_bytes):
        if len(bucket) == 1:
            dist.all_reduce(bucket[0], op=dist.ReduceOp.SUM, group=group)
            continue
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


@torch.no_grad()
def broadcast_module(module: torch.nn.Module, group, src: int = 0) -> None:
    """Rank `src`'s parameters and buffers on every rank: the ranks start from identical weights even
    if their model loading or initialisation differed."""
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, src=src, group=group)
