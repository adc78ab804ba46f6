"""The `torch` TrainBackend: a plain PyTorch model + AdamW, CPU or GPU; one process, or one process per
data-parallel rank (`tasks/train/data_parallel.py`)."""

from __future__ import annotations

import copy
import functools
import io

import torch

from rollflow.tasks.model.dtypes import DTYPES, cast_model
from rollflow.tasks.model.teacher_forced import gather_log_probs, next_token_logits, teacher_forced_log_probs
from rollflow.tasks.pinned import HostShelf
from rollflow.tasks.progress import Progress
from rollflow.tasks.sync.resident import ResidentWeights
from rollflow.tasks.train.batch import TrainBatch
from rollflow.tasks.train.data_parallel import (
    DataParallel,
    all_reduce_grads,
    broadcast_module,
    init_data_parallel,
    shard_rows,
    sum_stats,
)
from rollflow.tasks.train.lora import LORA_FORMAT
from rollflow.tasks.train.losses import entropy_from_logits
from rollflow.tasks.train.objective import STAT_NAMES, Denominators, micro_batch_objective, minibatch_steps
from rollflow.tasks.train.settings import AlgoConfig, OptimConfig


def response_log_probs(
    model, batch: TrainBatch, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Teacher-forced log-prob of every next token, target aligned [B, L-1], fp32.

    The numerics are tasks/model/teacher_forced.py's, which the `hf` engine also runs for
    rollout.logprobs='teacher_forced' (bitwise equal rollout log-probs)."""
    device = next(model.parameters()).device
    logits = next_token_logits(model, batch.tokens, batch.attention_mask, batch.position_ids, temperature, batch.routes)
    log_probs = gather_log_probs(logits, batch.tokens)
    entropy = entropy_from_logits(logits) if with_entropy else None
    return log_probs.cpu() if device.type != "cpu" else log_probs, (
        entropy.cpu() if entropy is not None and device.type != "cpu" else entropy
    )


def split_rows(batch: TrainBatch, size: int) -> list[TrainBatch]:
    return [batch.select(slice(i, i + size)) for i in range(0, batch.size, size)]


class TorchBackend:
    name = "torch"

    def __init__(
        self,
        model,
        optim: OptimConfig,
        *,
        temperature: float = 1.0,
        keep_ref: bool = True,
        dp: DataParallel | None = None,
    ):
        torch.set_num_threads(optim.threads)
        torch.manual_seed(optim.seed)  # the same seed on every rank
        self.optim_cfg = optim
        self.temperature = temperature if temperature > 0 else 1.0
        self.dp = dp
        if dp is not None and dp.enabled and dp.backend == "nccl":
            device = torch.device(optim.device)
            if device.type != "cuda":
                raise ValueError(
                    f"DataParallel.backend='nccl' needs train.device=cuda (got {optim.device!r}); "
                    "use backend='gloo' on CPU"
                )
            if device.index is not None:
                torch.cuda.set_device(device)  # NCCL binds each rank to its current device
        # None on one rank: then nothing below runs a collective and the numerics are the single-rank ones.
        self.group = init_data_parallel(dp) if dp is not None else None
        # Parameters cast, RoPE inv_freq kept as loaded: the same model as an engine loaded in this dtype.
        self.model = cast_model(model, DTYPES[optim.dtype], optim.device)
        self._resident: ResidentWeights | None = None
        self._offloaded = False  # `offload` moved the state to host memory; `onload` brings it back
        self._shelf = HostShelf()  # the pinned host buffers it moves into, kept for the next offload
        # Micro-batches trained and batches scored, read from the control group by a stall deadline.
        self.progress = Progress()
        if self.group is not None:
            broadcast_module(self.model, self.group)
        # The reference is the starting policy, frozen; kept before any checkpoint is loaded.
        self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False) if keep_ref else None
        self.optimizer = torch.optim.AdamW(
            # What trains (all of a plain model; a LoRA policy's adapter only: tasks/train/lora_backend.py).
            [p for p in self.model.parameters() if p.requires_grad],
            lr=optim.lr,
            weight_decay=optim.weight_decay,
            betas=(optim.adam_beta1, optim.adam_beta2),
        )

    @property
    def rank(self) -> int:
        return self.dp.rank if self.group is not None else 0

    @property
    def vocab_size(self) -> int | None:
        """The HF config's vocabulary size (None: the model has no config saying it)."""
        value = getattr(getattr(self.model, "config", None), "vocab_size", None)
        return value if isinstance(value, int) else None

    # -- colocated placement: free the GPU while the engine generates -----------------------------------

    def offload(self) -> None:
        """Policy and reference weights and the AdamW state to pinned host memory (grads dropped: every train
        call starts from zeroed grads) while a colocated engine generates; `onload` brings them back bit for
        bit. A no-op off CUDA and when already offloaded."""
        if torch.device(self.optim_cfg.device).type != "cuda" or self._offloaded:
            return
        self.optimizer.zero_grad(set_to_none=True)
        movable = {("t", n): t for n, t in enumerate(self._movable())}
        state_of = {
            ("state", n, k): (state, v)
            for n, state in enumerate(self.optimizer.state.values())
            for k, v in state.items()
            if isinstance(v, torch.Tensor) and v.is_cuda
        }
        bufs = self._shelf.place(
            {**{k: t.data for k, t in movable.items()}, **{k: v for k, (_, v) in state_of.items()}}
        )
        for key, t in movable.items():
            t.data = bufs[key].copy_(t.data, non_blocking=True)
        for key, (state, v) in state_of.items():
            state[key[2]] = bufs[key].copy_(v, non_blocking=True)
        torch.cuda.synchronize()
        self._offloaded, self._resident = True, None  # the resident views pointed at the GPU storage
        torch.cuda.empty_cache()

    def onload(self) -> None:
        """Undo `offload`."""
        if not self._offloaded:
            return
        device = torch.device(self.optim_cfg.device)
        for t in self._movable():
            t.data = t.data.to(device, non_blocking=True)
        for n, state in enumerate(self.optimizer.state.values()):
            for k, v in state.items():
                # AdamW keeps `step` on the host unless capturable / fused: only what offload moved goes back
                if v is self._shelf.slots.get(("state", n, k)):
                    state[k] = v.to(device, non_blocking=True)
        torch.cuda.synchronize()
        self._offloaded = False

    def _movable(self) -> list[torch.Tensor]:
        models = [m for m in (self.model, self.ref_model) if m is not None]
        return [t for m in models for t in (*m.parameters(), *m.buffers())]

    @property
    def world_size(self) -> int:
        return self.dp.world_size if self.group is not None else 1

    @torch.no_grad()
    def compute_log_probs(self, batch: TrainBatch, which: str = "policy") -> torch.Tensor:
        model = self.model if which == "policy" else self.ref_model
        if model is None:
            raise RuntimeError("reference log-probs requested but the trainer was built without a reference model")
        # Same micro-batch split as the training forward: numerics then match bit for bit. The hf engine
        # runs this same function for rollout.logprobs='teacher_forced' (tasks/model/teacher_forced.py).
        # Data parallel: every rank scores the whole batch, no collective. Advantages need every row
        # anyway, the old/ref log-probs are then bitwise the single-rank ones on every rank, and this
        # method can be called on one rank alone (alignment checks). The cost is redundant forwards.
        self.progress.tick()
        return teacher_forced_log_probs(
            model,
            batch.tokens,
            batch.attention_mask,
            batch.position_ids,
            temperature=self.temperature,
            micro_batch_size=self.optim_cfg.micro_batch_size,
            routes=batch.routes,
        )

    def train(self, batch: TrainBatch, algo: AlgoConfig, on_step=None) -> dict[str, float]:
        """`num_steps_per_rollout` optimizer steps over consecutive mini-batches; mean of step stats
        (`on_step` gets each step's own: objective.minibatch_steps)."""
        self._gradient_forward_mode()

        def micro_step(micro: TrainBatch, denom: Denominators) -> dict[str, float]:
            log_probs, entropy = response_log_probs(self.model, micro, self.temperature, True)
            loss, stats = micro_batch_objective(log_probs, entropy, micro, algo, denom)
            loss.backward()
            self.progress.tick()
            return stats

        local_rows = stats_sum = None
        if self.group is not None:
            # This rank's share of each (single-rank) mini-batch; statistics are summed across ranks.
            local_rows = functools.partial(shard_rows, rank=self.dp.rank, world=self.dp.world_size)
            stats_sum = functools.partial(sum_stats, group=self.group, names=STAT_NAMES)

        def optimizer_step() -> float:
            if self.group is not None:
                # Before clipping, so the norm (and the clip) is that of the global gradient.
                all_reduce_grads(self.model.parameters(), self.group)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_cfg.grad_clip)
            if not torch.isfinite(grad_norm):
                return float(grad_norm)  # a NaN/inf gradient never reaches the weights (nor Adam's moments)
            self.optimizer.step()
            return float(grad_norm)

        return minibatch_steps(
            batch,
            self.optim_cfg.num_steps_per_rollout,
            self.optim_cfg.micro_batch_size,
            zero_grad=lambda: self.optimizer.zero_grad(set_to_none=True),
            micro_step=micro_step,
            optimizer_step=optimizer_step,
            local_rows=local_rows,
            sum_stats=stats_sum,
            on_step=on_step,
        )

    def _gradient_forward_mode(self) -> None:
        # eval(): no dropout, so the training forward is the same function as the scoring forward.
        self.model.eval()

    def named_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """The weights where they live (no host copy; Parameters themselves, read-only): the source of a
        device-to-device sync and of checksums computed on the device."""
        if self._resident is None:
            self._resident = ResidentWeights(self.model)
        return self._resident.tensors()

    def checkpoint_bytes(self) -> bytes:
        buf = io.BytesIO()
        torch.save(
            {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "rng": torch.get_rng_state()},
            buf,
        )
        return buf.getvalue()

    def load_checkpoint_bytes(self, data: bytes) -> None:
        # weights_only: a checkpoint is data, never code.
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        if state.get("format") == LORA_FORMAT:
            raise ValueError(
                "the checkpoint holds a LoRA adapter (written with model.lora set), not full weights: resume "
                "with the same model.lora, or start a new run"
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
