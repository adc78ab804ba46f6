"""The `megatron` TrainBackend: a megatron-core GPTModel for the Llama / Qwen2 / Qwen3 family, one rank of a
TP x PP x DP layout (docs/megatron.md, "Parallel training").

Behind the same protocol as `torch_backend.TorchBackend` (tasks/train/step.py: TrainBackend): the same
TrainBatch layout, the same `micro_batch_objective`, the same `train/*` metric names. Weights come in
and go out with HF names through `rollflow.tasks.sync.megatron_names`, so the engine sync and the parity check
(`rollflow.tasks.sync.parity.compare`) are unchanged.

megatron-core is imported lazily: this module imports on a CPU box without it, and building the backend
there raises `MegatronMissing` with the install line (process.py).

The rest of the wing: the model and its layer specs (build.py, layers.py, attention.py), HF weights in and out
(hf_weights.py), the optimizers (optimizer.py), host offload (offload.py), Megatron's schedule (schedule.py),
context / vocabulary parallelism (context_parallel.py, vocab_parallel.py) and the kernels (fused_ops.py: the
one-pass log-prob / entropy kernel, `log_prob_impl`; on the H200 the kernels take the ~0.9B Llama from 46% to
54% MFU with step-1 exactness intact, docs/megatron.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import json
import math
import os
from collections.abc import Iterator
from typing import Any

import torch

from rollflow.tasks.model.dtypes import DTYPES
from rollflow.tasks.model.tiny import load_model
from rollflow.tasks.pinned import HostShelf
from rollflow.tasks.progress import Progress
from rollflow.tasks.sync import megatron_names as mn
from rollflow.tasks.sync.buckets import buckets_by_bytes
from rollflow.tasks.train.batch import TrainBatch
from rollflow.tasks.train.data_parallel import DataParallel, shard_rows, sum_stats
from rollflow.tasks.train.megatron.build import build_gpt_model
from rollflow.tasks.train.megatron.context_parallel import gather_context
from rollflow.tasks.train.megatron.fused_ops import token_log_probs
from rollflow.tasks.train.megatron.hf_weights import (
    chunk_weights,
    gather_shards,
    layer_groups,
    load_hf_weights,
    virtual_stage,
)
from rollflow.tasks.train.megatron.layers import resolve_layer_spec
from rollflow.tasks.train.megatron.offload import offload_to_host, onload_from_host
from rollflow.tasks.train.megatron.optimizer import MasterAdamW, build_megatron_optimizer, inner_optimizers
from rollflow.tasks.train.megatron.process import cpu_shims, init_parallel_state, require_megatron
from rollflow.tasks.train.megatron.schedule import (
    ModelInput,
    model_inputs,
    packed_model_inputs,
    run_schedule,
    schedule_loss_scale,
    split_context,
    token_budget_micro_batches,
    unpack_token_values,
)
from rollflow.tasks.train.megatron.vocab_parallel import vocab_parallel_log_probs
from rollflow.tasks.train.objective import STAT_NAMES, Denominators, micro_batch_objective, minibatch_steps
from rollflow.tasks.train.settings import AlgoConfig, OptimConfig
from rollflow.tasks.train.torch_backend import split_rows

# Written last by `MegatronBackend.save_distributed`: only a directory with it is a checkpoint.
COMMIT_MARKER = "rollflow_commit.json"


def _seq_first_logits(
    *, hidden_states, output_layer, output_weight=None, runtime_gather_output=None, scale_logits=None, **_unused
):
    """A GPTModel `output_processor` (megatron-core >= 0.19): the output layer's [s, b, V] logits as they are."""
    logits, _ = output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
    return scale_logits(logits) if scale_logits is not None else logits


def _accepts_output_processor(model) -> bool:
    cls = type(model)
    cached = getattr(cls, "_rollflow_output_processor", None)
    if cached is None:
        cached = "output_processor" in inspect.signature(cls.forward).parameters
        cls._rollflow_output_processor = cached
    return cached


def batch_to(batch: TrainBatch, device: torch.device) -> TrainBatch:
    return TrainBatch(
        **{
            f.name: (v.to(device, non_blocking=True) if isinstance(v := getattr(batch, f.name), torch.Tensor) else v)
            for f in dataclasses.fields(batch)
        }
    )


class MegatronBackend:
    """One rank of the megatron trainer: its TP shard of its pipeline stage, in its data-parallel replica.

    Two paths, by `train.megatron.optimizer`:
      - "megatron" (CUDA; any tp / pp / dp): Megatron's DistributedDataParallel, its schedule
        (`get_forward_backward_func`: 1F1B when pp > 1) with `finalize_model_grads`, its optimizer
        (distributed optimizer optional, global-norm clipping over all model-parallel ranks) and its LR
        scheduler (warmup + decay). Vocab-parallel log-probs when tp > 1.
      - "torch" (one rank; also runs on CPU): rollflow's own micro-batch loop and AdamW on fp32 masters.
    Every rank holds the whole TrainBatch; rank r of the data-parallel group trains on its contiguous share
    of each mini-batch (`data_parallel.shard_rows`), as the torch backend's data parallel does.
    """

    name = "megatron"

    def __init__(
        self,
        hf_config,
        hf_state: dict[str, torch.Tensor] | None,
        optim: OptimConfig,
        *,
        temperature: float = 1.0,
        keep_ref: bool = True,
        dp: DataParallel | None = None,
    ):
        require_megatron()
        from megatron.core import parallel_state as ps  # optional dependency: imported on use

        torch.set_num_threads(optim.threads)
        torch.manual_seed(optim.seed)
        self.optim_cfg = optim
        self.progress = Progress()  # micro-batch forwards (train and scoring): a stall deadline's sign of life
        self.device = torch.device(optim.device)
        self.settings = optim.megatron.resolved(self.device.type)
        self.temperature = temperature if temperature > 0 else 1.0
        self.dtype = DTYPES[optim.dtype]
        self.optimizer_kind = self.settings.optimizer
        if self.optimizer_kind == "auto":
            self.optimizer_kind = "megatron" if self.device.type == "cuda" else "torch"
        s = self.settings
        megatron_only = [
            name
            for name, on in (
                ("use_distributed_optimizer", s.use_distributed_optimizer),
                ("overlap_grad_reduce", s.overlap_grad_reduce),
                ("lr_warmup_steps", s.lr_warmup_steps > 0),
                ("lr_decay_style", s.lr_decay_style != "constant"),
                ("max_tokens_per_gpu", s.max_tokens_per_gpu is not None),
            )
            if on
        ]
        if s.packing != "off":
            megatron_only.append("packing")
        if self.optimizer_kind == "torch" and megatron_only:
            raise ValueError(
                f"train.megatron.{megatron_only[0]} needs optimizer='megatron' (Megatron's DDP, optimizer "
                "and scheduler); with optimizer='torch' it would do nothing"
            )
        world = dp.world_size if dp is not None else int(os.environ.get("WORLD_SIZE", 1))
        if self.optimizer_kind == "torch" and world > 1:
            raise ValueError(
                f"train.megatron.optimizer='torch' runs one rank (got world size {world}): use "
                "optimizer='megatron' (Megatron's DDP, schedule and optimizer) for tp / pp / dp > 1"
            )
        init_parallel_state(self.device, optim.seed, settings=self.settings, dp=dp)
        self.tp_rank, self.tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        self.pp_rank, self.pp_size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.cp_rank = ps.get_context_parallel_rank()
        random_init = hf_state is None
        if self.device.type != "cuda" and resolve_layer_spec(self.settings.layer_spec) != "sdpa":
            raise ValueError(
                "on CPU the megatron backend runs only train.megatron.layer_spec='sdpa' (the local "
                "spec's attention forks Megatron's CUDA RNG tracker)"
            )
        # One model chunk per virtual pipeline stage (vpp); one chunk otherwise. `self.model` is the first.
        self.chunks: list[torch.nn.Module] = []
        for vp in [None] if self.settings.vpp is None else range(self.settings.vpp):
            chunk, self.layout, self.layer_spec = build_gpt_model(
                hf_config, self.settings, dtype=self.dtype, device=self.device, random_init=random_init, vp_stage=vp
            )
            if hf_state is not None:
                load_hf_weights(chunk, hf_state, self.layout, vp_stage=vp)
            self.chunks.append(chunk)
        self.model = self.chunks[0]
        self._host_weights: dict[tuple, torch.Tensor] | None = None  # set while offloaded
        self._offloaded_opt_params: dict[tuple, torch.Tensor] = {}
        # The reference is the starting policy, frozen: kept as a host copy (pinned on CUDA) and swapped into
        # the one model for the reference pass, so no second model sits in GPU memory (slime does the same).
        self._ref_state: dict[str, torch.Tensor] | None = None
        self._shelf = HostShelf(pin=self.device.type == "cuda")  # pinned host buffers: offload's and the reference's
        if keep_ref:
            weights = self._weights()
            bufs = self._shelf.place({("ref", k): v for k, v in weights.items()})
            self._ref_state = {k: bufs[("ref", k)].copy_(v.detach()) for k, v in weights.items()}
        self._build_optimizer()

    # -- optimizer ---------------------------------------------------------------------------------

    def _build_optimizer(self) -> None:
        self.scheduler = None
        if self.optimizer_kind == "torch":
            self.ddp = None
            self.ddps: list = []
            self.train_model = self.model
            self.optimizer = MasterAdamW([p for p in self.model.parameters() if p.requires_grad], self.optim_cfg)
            return
        if self.optimizer_kind != "megatron":
            raise ValueError(f"train.megatron.optimizer={self.optimizer_kind!r}: expected auto, megatron or torch")
        self.ddps, self.optimizer, self.scheduler = build_megatron_optimizer(
            self.chunks, self.settings, self.optim_cfg, self.dtype
        )
        self.ddp = self.ddps[0]
        self.train_model = self.ddp

    def _zero_grad(self) -> None:
        for ddp in self.ddps:
            ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _optimizer_step(self) -> float:
        if self.ddp is None:
            return self.optimizer.step()
        # Megatron checks for inf only under fp16 loss scaling; bf16/fp32 would clip by a NaN norm and write NaN
        # weights, so look at the reduced grads first (one flag, agreed by every rank).
        grads = [
            p.main_grad
            for chunk in self.chunks
            for p in chunk.parameters()
            if getattr(p, "main_grad", None) is not None
        ]
        bad = torch.zeros(1, dtype=torch.float32, device=grads[0].device if grads else self.device)
        if grads and not bool(torch.stack([g.float().norm() for g in grads]).isfinite().all()):
            bad += 1
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        if bad.item():
            return float("nan")
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise FloatingPointError("Megatron optimizer step was skipped (inf/nan gradients)")
        self.scheduler.step(increment=1)
        return float(grad_norm)

    @property
    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # -- forward -------------------------------------------------------------------------------------

    def _log_probs(self, model, micro: TrainBatch, *, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced log-prob (and entropy) of every next token, target aligned [B, L-1], fp32, on device."""
        self.progress.tick()
        tokens = micro.tokens.to(self.device, torch.long, non_blocking=True)
        position_ids = micro.position_ids.to(self.device, non_blocking=True)
        kwargs = dict(
            temperature=self.temperature,
            vocab_size=self.layout.vocab_size,
            chunk=self.settings.log_prob_chunk,
            impl=self.settings.log_prob_impl,
            entropy_grad=entropy_grad,
        )
        with cpu_shims(self.device):
            if _accepts_output_processor(self.model):
                # Sequence-first logits [L, B, V_pad] straight from the output layer: logits[:-1] is then a
                # contiguous prefix, so no [B, L, V] transpose copy and no slice copy (forward or backward).
                logits = model(
                    input_ids=tokens, position_ids=position_ids, attention_mask=None, output_processor=_seq_first_logits
                )
                lp, ent = token_log_probs(logits[:-1], tokens[:, 1:].t(), **kwargs)
                return lp.t(), ent.t()
            logits = model(input_ids=tokens, position_ids=position_ids, attention_mask=None)  # [B, L, V_pad]
        return token_log_probs(logits[:, :-1], tokens[:, 1:], **kwargs)

    def _forward_kwargs(self) -> dict[str, Any]:
        # megatron-core >= 0.19: sequence-first [s, b, V/tp] logits straight from the output layer (no transpose
        # copy of the logits); older releases return [b, s, V/tp].
        # One stage only: how 0.19 treats the hook on stages without the output layer is not verified here.
        use = self.pp_size == 1 and _accepts_output_processor(self.model)
        return {"output_processor": _seq_first_logits} if use else {}

    def _output_log_probs(
        self, item: ModelInput, logits: torch.Tensor, *, entropy_grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs / entropy [rows, width - 1] of the real rows and columns of the last stage's logits."""
        n, width = item.n_real, item.width
        seq_first = bool(self._forward_kwargs())
        if item.cp > 1:
            return self._context_log_probs(item, logits, seq_first=seq_first, entropy_grad=entropy_grad)
        if item.packed is not None:  # [T, 1, V] / [1, T, V]: every position scores the next packed token
            flat = logits[:-1, 0] if seq_first else logits[0, :-1]
            lp, ent = self._vocab_log_probs(flat, item.tokens[0, 1:], entropy_grad=entropy_grad)
            return unpack_token_values(lp, item), unpack_token_values(ent, item)
        logits = logits[: width - 1, :n] if seq_first else logits[:n, : width - 1]
        target = item.tokens[:n, 1:width]
        target = target.t() if seq_first else target
        lp, ent = self._vocab_log_probs(logits, target, entropy_grad=entropy_grad)
        return (lp.t(), ent.t()) if seq_first else (lp, ent)

    def _context_log_probs(
        self, item: ModelInput, logits: torch.Tensor, *, seq_first: bool, entropy_grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Context parallel: this rank's positions scored against their next tokens, then every cp rank's values
        gathered back into sequence order (context_parallel.py: each rank's backward keeps its own positions)."""
        from megatron.core import parallel_state as ps  # optional dependency: imported on use

        targets = item.cp_targets.t() if seq_first or item.packed is not None else item.cp_targets
        if item.packed is not None:  # [t, 1, V] / [1, t, V] -> [t, V]
            logits = logits[:, 0] if seq_first else logits[0]
            targets = targets[:, 0]
        lp, ent = self._vocab_log_probs(logits, targets, entropy_grad=entropy_grad)
        if not seq_first and item.packed is None:  # [b, s] -> [s, b]: the gather runs along dim 0
            lp, ent = lp.t(), ent.t()
        both = gather_context(
            torch.stack((lp, ent), dim=-1), item.cp_order, ps.get_context_parallel_group(), backward="slice"
        )
        lp, ent = both.unbind(-1)
        if item.packed is not None:
            return unpack_token_values(lp[:-1], item), unpack_token_values(ent[:-1], item)
        return lp[: item.width - 1, : item.n_real].t(), ent[: item.width - 1, : item.n_real].t()

    def _vocab_log_probs(
        self, logits: torch.Tensor, target: torch.Tensor, *, entropy_grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """log p(target) and entropy over the real vocabulary, reduced over the TP group when it is split."""
        if self.tp_size > 1:
            from megatron.core import parallel_state as ps  # optional dependency: imported on use

            lp, ent = vocab_parallel_log_probs(
                logits,
                target,
                vocab_start=self.tp_rank * logits.shape[-1],
                vocab_size=self.layout.vocab_size,
                temperature=self.temperature,
                group=ps.get_tensor_model_parallel_group(),
            )
        else:
            lp, ent = token_log_probs(
                logits,
                target,
                temperature=self.temperature,
                vocab_size=self.layout.vocab_size,
                chunk=self.settings.log_prob_chunk,
                impl=self.settings.log_prob_impl,
                entropy_grad=entropy_grad,
            )
        return lp, ent

    def _model_inputs(self, batch: TrainBatch, micros: list[TrainBatch]) -> list[ModelInput]:
        items = self._whole_model_inputs(batch, micros)
        cp = self.settings.cp
        return items if cp == 1 else [split_context(item, cp, self.cp_rank) for item in items]

    def _whole_model_inputs(self, batch: TrainBatch, micros: list[TrainBatch]) -> list[ModelInput]:
        """The micro-batches as the whole model sees them (before a context-parallel split)."""
        cp = self.settings.cp
        # Sequence parallel: each cp rank's share a multiple of tp; context parallel: 2 x cp chunks per sequence.
        multiple = cp * math.lcm(self.tp_size if self.settings.sequence_parallel else 1, 2 if cp > 1 else 1)
        empty = batch.select(slice(0, 0))
        if self.settings.packing == "thd":
            if len(self.chunks) > 1 and len(micros) < self.pp_size:
                micros = list(micros or [empty]) + [empty] * (self.pp_size - max(len(micros), 1))
            multiple = math.lcm(multiple, self.settings.pack_multiple)
            return packed_model_inputs(
                micros,
                width_multiple=multiple,
                device=self.device,
                empty=empty,
                same_length=self.pp_size > 1,
                row_multiple=2 * cp if cp > 1 else 1,
            )
        if self.pp_size == 1:  # no activations between stages: each micro-batch keeps its own rows and width
            return [
                item
                for m in (micros or [empty])
                for item in model_inputs([m], rows=max(m.size, 1), device=self.device, empty=m, width_multiple=multiple)
            ]
        if len(self.chunks) > 1 and len(micros) < self.pp_size:
            # The interleaved schedule needs at least pp micro-batches: all-padding ones fill up (loss 0).
            micros = list(micros or [empty]) + [empty] * (self.pp_size - max(len(micros), 1))
        return model_inputs(
            micros, rows=self.optim_cfg.micro_batch_size, device=self.device, empty=empty, width_multiple=multiple
        )

    @property
    def _reports_stats(self) -> bool:
        """One rank per data-parallel replica reports the replica's statistics (its last stage, tp / cp rank 0)."""
        return self.pp_rank == self.pp_size - 1 and self.tp_rank == 0 and self.cp_rank == 0

    def _schedule_log_probs(self, batch: TrainBatch) -> torch.Tensor:
        rows = shard_rows(batch.size, self.dp_rank, self.dp_size)
        mine = batch.select(rows)
        micros = self._micro_batches(mine)

        def loss_fn(item, logits, _num_microbatches):
            lp, _ = self._output_log_probs(item, logits, entropy_grad=False)
            return logits.new_zeros(()), {"log_probs": lp.float().cpu()}

        with cpu_shims(self.device):
            data = run_schedule(
                self.chunks,
                self._model_inputs(mine, micros),
                loss_fn,
                forward_only=True,
                forward_kwargs=self._forward_kwargs(),
                on_micro_batch=self.progress.tick,
            )
        out = torch.zeros((batch.size, batch.tokens.shape[1] - 1), dtype=torch.float32)
        if self._reports_stats and mine.size:
            row = rows.start
            for d in data:  # micro-batches in order; token-budget ones are narrower than the batch
                lp = d["log_probs"]
                out[row : row + lp.shape[0], : lp.shape[1]] = lp
                row += lp.shape[0]
        # Every rank gets every row: the sum of the reporting ranks' disjoint rows (zeros elsewhere) is exact.
        flat = out.to(self._collective_device())
        torch.distributed.all_reduce(flat)
        return flat.cpu()

    def _collective_device(self) -> torch.device:
        return self.device if torch.distributed.get_backend() == "nccl" else torch.device("cpu")

    def reference_tensors(self) -> dict[str, torch.Tensor] | None:
        """The frozen reference's host copies by the model's own names (None without a reference): what the
        alignment drills perturb in place."""
        return self._ref_state

    def reset_reference(self) -> None:
        """The reference becomes the current weights (a drill that replaced the starting weights)."""
        if self._ref_state is not None:
            with torch.no_grad():
                for name, tensor in self._weights().items():
                    self._ref_state[name].copy_(tensor.detach())

    @torch.no_grad()
    def compute_log_probs(self, batch: TrainBatch, which: str = "policy") -> torch.Tensor:
        if which != "policy" and self._ref_state is None:
            raise RuntimeError("reference log-probs requested but the trainer was built without a reference model")
        with self._weights_of(which):
            was_training = self.model.training
            for chunk in self.chunks:
                chunk.eval()
            if self.ddp is not None:
                lp = self._schedule_log_probs(batch)
            else:
                # Same micro-batch split as the training forward: numerics then match bit for bit.
                lp = torch.cat(
                    [
                        self._log_probs(self.model, mb, entropy_grad=False)[0].cpu()
                        for mb in split_rows(batch, self.optim_cfg.micro_batch_size)
                    ],
                    dim=0,
                )
            for chunk in self.chunks:
                chunk.train(was_training)
        return lp

    def _weights(self) -> dict[str, torch.Tensor]:
        """Every chunk's tensors, keyed `{chunk}/{name}`."""
        return {f"{i}/{k}": v for i, chunk in enumerate(self.chunks) for k, v in chunk_weights(chunk).items()}

    @contextlib.contextmanager
    def _weights_of(self, which: str):
        """The policy's weights as they are, or the reference's swapped in (and the policy's put back after)."""
        if which == "policy":
            yield
            return
        own = self._weights()
        saved = {k: v.detach().to("cpu", copy=True) for k, v in own.items()}
        with torch.no_grad():
            for k, v in own.items():
                v.copy_(self._ref_state[k], non_blocking=True)
        try:
            yield
        finally:
            with torch.no_grad():
                for k, v in own.items():
                    v.copy_(saved[k], non_blocking=True)

    def micro_step(self, micro: TrainBatch, algo: AlgoConfig, denom: Denominators) -> dict[str, float]:
        """Forward, objective and backward of one micro-batch (grads accumulate); the optimizer='torch' path."""
        log_probs, entropy = self._log_probs(self.train_model, micro, entropy_grad=algo.entropy_coef > 0)
        loss, stats = micro_batch_objective(log_probs, entropy, batch_to(micro, self.device), algo, denom)
        loss.backward()
        return stats

    def _micro_batches(self, rows: TrainBatch) -> list[TrainBatch]:
        """This rank's rows as micro-batches: by token budget (`max_tokens_per_gpu`) or `micro_batch_size` rows."""
        budget = self.settings.max_tokens_per_gpu
        if budget is not None:  # per GPU: a context-parallel group holds cp times as many tokens
            return token_budget_micro_batches(rows, budget * self.settings.cp, packed=self.settings.packing == "thd")
        size = self.optim_cfg.micro_batch_size
        return [rows.select(slice(i, i + size)) for i in range(0, rows.size, size)]

    def _schedule_micro_batches(
        self, batch: TrainBatch, micros: list[TrainBatch], algo: AlgoConfig, denom: Denominators
    ) -> dict[str, float]:
        """This rank's micro-batches of one mini-batch through Megatron's schedule; summed statistics."""
        if self.settings.max_tokens_per_gpu is not None:  # minibatch_steps handed the rank's rows as one
            micros = [m for rows in micros for m in self._micro_batches(rows)]

        def loss_fn(item: ModelInput, logits: torch.Tensor, num_microbatches: int):
            if item.n_real == 0:  # a rank without rows: a zero loss that still reaches every parameter
                return logits.sum() * 0.0, {}
            lp, ent = self._output_log_probs(item, logits, entropy_grad=algo.entropy_coef > 0)
            loss, stats = micro_batch_objective(lp, ent, batch_to(item.micro, self.device), algo, denom)
            return loss * schedule_loss_scale(num_microbatches, self.dp_size), stats

        with cpu_shims(self.device):
            data = run_schedule(
                self.ddps,
                self._model_inputs(batch, micros),
                loss_fn,
                forward_only=False,
                forward_kwargs=self._forward_kwargs(),
                on_micro_batch=self.progress.tick,
            )
        acc: dict[str, float] = {}
        if self._reports_stats:
            for stats in data:
                for key, value in stats.items():
                    acc[key] = acc.get(key, 0.0) + value
        return acc

    def train(self, batch: TrainBatch, algo: AlgoConfig, on_step=None) -> dict[str, float]:
        """`num_steps_per_rollout` optimizer steps over consecutive mini-batches; mean of step stats
        (`on_step` gets each step's own: objective.minibatch_steps)."""
        # train(): Megatron's activation recompute runs only in training mode. Dropout is 0, so the training
        # forward is still the same function as the scoring forward (step-1 exactness).
        for chunk in self.chunks:
            chunk.train()
        if self.ddp is None:
            return minibatch_steps(
                batch,
                self.optim_cfg.num_steps_per_rollout,
                self.optim_cfg.micro_batch_size,
                zero_grad=self._zero_grad,
                micro_step=lambda micro, denom: self.micro_step(micro, algo, denom),
                optimizer_step=self._optimizer_step,
                on_step=on_step,
            )
        names = STAT_NAMES + tuple(k for k in ("kl_loss",) if k not in STAT_NAMES)
        rows_per_micro = self.optim_cfg.micro_batch_size if self.settings.max_tokens_per_gpu is None else batch.size
        return minibatch_steps(
            batch,
            self.optim_cfg.num_steps_per_rollout,
            rows_per_micro,
            zero_grad=self._zero_grad,
            micro_step=None,
            optimizer_step=self._optimizer_step,
            local_rows=lambda n: shard_rows(n, self.dp_rank, self.dp_size),
            sum_stats=lambda stats: sum_stats(stats, None, names),
            run_micro_batches=lambda micros, denom: self._schedule_micro_batches(batch, micros, algo, denom),
            on_step=on_step,
        )

    # -- colocated placement: free the GPU while the engine generates -----------------------------------

    def offload(self) -> None:
        """Move this rank's weights, main grads and optimizer state to host memory (pinned) so a colocated
        engine can use the GPU; `onload` brings them back, bit for bit (offload.py says how). A no-op on CPU and
        when offloaded."""
        if self.device.type != "cuda" or self._host_weights is not None:
            return
        if self.ddp is None:
            raise NotImplementedError(
                "offload needs train.megatron.optimizer='megatron' (Megatron's grad buffers "
                "and optimizer state know how to move); optimizer='torch' keeps its state"
            )
        self._host_weights, self._offloaded_opt_params = offload_to_host(
            self.chunks, self.ddps, inner_optimizers(self.optimizer), self.device, self._shelf
        )

    def onload(self) -> None:
        """Undo `offload`: weights, (zeroed) grad buffers and optimizer state back on the GPU."""
        if self._host_weights is None:
            return
        onload_from_host(
            self.chunks,
            self.ddps,
            inner_optimizers(self.optimizer),
            self._host_weights,
            self._offloaded_opt_params,
            self.device,
        )
        self._host_weights = None
        self._offloaded_opt_params = {}

    # -- weights and checkpoints -----------------------------------------------------------------------

    def named_weights(self) -> dict[str, torch.Tensor]:
        """HF-named tensors of the whole model (vocab padding removed), host copies, for the engine sync and
        `rollflow.tasks.sync.parity`: `export_buckets` collected. Every rank returns the same full dict (a
        collective when the model is sharded)."""
        return {name: t.to("cpu", copy=True) for bucket in self.export_buckets(1 << 30) for name, t in bucket}

    def export_buckets(
        self, bucket_bytes: int, dtype: torch.dtype | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The whole model's HF-named tensors on this rank's device, about `bucket_bytes` (in `dtype`, when given)
        at a time, for the sync paths: no whole-model copy and no host round trip.

        Each pipeline stage converts its own layers, one layer at a time: the layer's TP shards all-gathered on
        the device, merged and renamed with the stage's layer offset. Each bucket is then broadcast over the
        pipeline group from its stage, so every rank gets the same buckets in the same order. Every rank of the
        model must iterate this to the end together (the gathers and broadcasts are collectives); a bucket's
        tensors may be views of the live weights: read them before the next optimizer step."""
        for stage in range(self.pp_size):
            if stage == self.pp_rank:
                for bucket in buckets_by_bytes(self._stage_hf_tensors(dtype), bucket_bytes):
                    yield self._share_bucket(bucket, stage)
                if self.pp_size > 1:
                    self._share_bucket(None, stage)  # the stage's end
            else:
                while (bucket := self._share_bucket(None, stage)) is not None:
                    yield bucket

    def _stage_hf_tensors(self, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
        from megatron.core import parallel_state as ps  # optional dependency: imported on use

        group = ps.get_tensor_model_parallel_group() if self.tp_size > 1 else None
        for vp, chunk in enumerate(self.chunks):
            index = virtual_stage(self.pp_rank, self.pp_size, vp if self.settings.vpp else None)
            local = chunk_weights(chunk)
            for names in layer_groups(local):
                part = {name: local[name].detach() for name in names}
                shards = [part] if group is None else gather_shards(part, self.tp_size, group)
                for name, tensor in mn.export_stage_to_hf(shards, self.layout, index).items():
                    yield name, tensor if dtype is None else tensor.to(dtype)

    def _share_bucket(
        self, bucket: list[tuple[str, torch.Tensor]] | None, stage: int
    ) -> list[tuple[str, torch.Tensor]] | None:
        """`stage`'s bucket on every rank of the pipeline group (None from the stage: its end)."""
        if self.pp_size == 1:
            return bucket
        from megatron.core import parallel_state as ps  # optional dependency: imported on use

        group = ps.get_pipeline_model_parallel_group()
        src = torch.distributed.get_global_rank(group, stage)
        owner = stage == self.pp_rank
        meta: list = [None if not owner or bucket is None else [(name, tuple(t.shape), t.dtype) for name, t in bucket]]
        torch.distributed.broadcast_object_list(
            meta, src=src, group=group, device=self.device if self.device.type == "cuda" else None
        )
        if meta[0] is None:
            return None
        tensors = (
            [t.contiguous() for _, t in bucket]
            if owner
            else [torch.empty(shape, dtype=dt, device=self.device) for _, shape, dt in meta[0]]
        )
        for tensor in tensors:
            torch.distributed.broadcast(tensor, src=src, group=group)
        return [(name, tensor) for (name, _, _), tensor in zip(meta[0], tensors)]

    def save_distributed(self, directory: str) -> None:
        """Megatron's distributed checkpoint (torch_dist): every rank writes its own shards of the model and
        of the optimizer, no rank gathers the whole state; loadable at another tp / pp / dp layout.

        Commit protocol as for rollouts: the payload first, `COMMIT_MARKER` last (rank 0, after a barrier);
        a directory without the marker is not a checkpoint. `directory` is a path every rank can write (a
        shared filesystem on several hosts) and must not hold an earlier checkpoint.
        """
        from megatron.core import dist_checkpointing  # optional dependency: imported on use

        path = os.path.abspath(directory)
        if os.path.exists(os.path.join(path, COMMIT_MARKER)):
            raise FileExistsError(f"{path} already holds a committed checkpoint; checkpoints are immutable")
        if torch.distributed.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
        torch.distributed.barrier()
        dist_checkpointing.save(self._sharded_state(), path)
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            meta = {
                "format": "rollflow-megatron-dist-1",
                "optimizer_kind": self.optimizer_kind,
                "layout": {"tp": self.tp_size, "pp": self.pp_size, "dp": self.dp_size},
            }
            with open(os.path.join(path, COMMIT_MARKER), "w") as fh:
                json.dump(meta, fh)
        torch.distributed.barrier()

    def load_distributed(self, directory: str) -> None:
        """Load a `save_distributed` checkpoint, written at any tp / pp / dp layout, into this one."""
        from megatron.core import dist_checkpointing  # optional dependency: imported on use

        path = os.path.abspath(directory)
        marker = os.path.join(path, COMMIT_MARKER)
        if not os.path.exists(marker):
            raise FileNotFoundError(
                f"{path} has no {COMMIT_MARKER}: not a committed megatron checkpoint (an "
                "interrupted save, or another format)"
            )
        with open(marker) as fh:
            meta = json.load(fh)
        if meta.get("optimizer_kind") != self.optimizer_kind:
            raise ValueError(
                f"checkpoint optimizer {meta.get('optimizer_kind')!r} != this backend's {self.optimizer_kind!r}"
            )
        loaded = dist_checkpointing.load(self._sharded_state(loading=True), path)
        for key, chunk in self._chunk_keys():
            missing, unexpected = chunk.load_state_dict(loaded[key], strict=False)
            missing = [k for k in missing if not k.endswith("_extra_state")]
            if missing or unexpected:
                raise ValueError(
                    f"checkpoint does not fit the model: missing {missing[:4]}, unexpected {unexpected[:4]}"
                )
        if "optimizer" in loaded:
            self.optimizer.load_state_dict(loaded["optimizer"])
        if self.scheduler is not None and "scheduler" in loaded:
            self.scheduler.load_state_dict(loaded["scheduler"])

    @property
    def sharded(self) -> bool:
        """True when no rank holds the whole state (tp / pp / cp > 1, virtual stages, or optimizer state sharded over
        DP): checkpoints are then `save_distributed` on every rank, and reading the weights is a collective."""
        return (
            self.settings.model_parallel_size > 1
            or len(self.chunks) > 1
            or (self.settings.use_distributed_optimizer and self.dp_size > 1)
        )

    def all_ranks_finite(self) -> bool:
        """Whether every rank's weight shards are free of NaN / inf (a collective: call it on every rank)."""
        local = all(bool(torch.isfinite(t).all()) for t in self._weights().values() if t.is_floating_point())
        flag = torch.tensor([1.0 if local else 0.0], device=self._collective_device())
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag.item() > 0)

    def _chunk_keys(self) -> list[tuple[str, torch.nn.Module]]:
        # Megatron-LM's names: "model", or "model0", "model1", ... with virtual pipeline stages.
        if len(self.chunks) == 1:
            return [("model", self.model)]
        return [(f"model{i}", chunk) for i, chunk in enumerate(self.chunks)]

    def _sharded_state(self, loading: bool = False) -> dict:
        # Sharded keys carry global layer ids (vp_stage-aware offsets), so any layout can load them.
        state: dict[str, Any] = {key: chunk.sharded_state_dict() for key, chunk in self._chunk_keys()}
        model_state = dict(state)
        if self.ddp is not None:
            # is_loading: Megatron creates the (empty) Adam moments first, so the load has tensors to fill.
            state["optimizer"] = self.optimizer.sharded_state_dict(model_state, is_loading=loading)
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def checkpoint_bytes(self) -> bytes:
        if len(self.chunks) > 1:
            raise NotImplementedError("virtual pipeline stages checkpoint through save_distributed only")
        buf = io.BytesIO()
        model_state = {k: v for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}
        torch.save(
            {
                "format": "rollflow-megatron-1",
                "model": model_state,
                "optimizer_kind": self.optimizer_kind,
                "optimizer": self.optimizer.state_dict(),
                "rng": torch.get_rng_state(),
            },
            buf,
        )
        return buf.getvalue()

    def load_checkpoint_bytes(self, data: bytes) -> None:
        # weights_only: a checkpoint is data, never code.
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        if state.get("format") != "rollflow-megatron-1":
            raise ValueError(
                "not a megatron-backend checkpoint (format tag missing); was it written by train.backend='torch'?"
            )
        if state["optimizer_kind"] != self.optimizer_kind:
            raise ValueError(
                f"checkpoint optimizer {state['optimizer_kind']!r} != this backend's {self.optimizer_kind!r}"
            )
        missing, unexpected = self.model.load_state_dict(state["model"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"checkpoint does not fit the model: missing {missing[:4]}, unexpected {unexpected[:4]}")
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])


def build_megatron_backend(
    model_dir, optim: OptimConfig, *, temperature: float, dp: DataParallel | None = None
) -> MegatronBackend:
    """From a local HF model directory (config.json + safetensors); `dp`: this rank's place in the trainer."""
    require_megatron()
    hf_model = load_model(model_dir)
    state = {k: v.detach() for k, v in hf_model.state_dict().items()}
    backend = MegatronBackend(hf_model.config, state, optim, temperature=temperature, dp=dp)
    del hf_model, state
    return backend
