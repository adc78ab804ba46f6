"""Optimizers of the megatron backend (`MegatronSettings.optimizer`):
- "megatron": Megatron's DistributedDataParallel grad buffers (fp32 main grads) + its optimizer
  (`get_megatron_optimizer`: fp32 master weights for bf16 params, clip_grad by global norm; without
  TE/apex its inner optimizer is torch.optim.AdamW) and its LR scheduler. CUDA only (Megatron hard-codes
  CUDA tensors).
- "torch": torch.optim.AdamW over fp32 master copies of the params, grads clipped by
  `torch.nn.utils.clip_grad_norm_`; same math, no Megatron wrappers; also runs on CPU.
- "auto": "megatron" on CUDA, "torch" on CPU.
"""

from __future__ import annotations

from typing import Any

import torch

from rollflow.tasks.train.settings import MegatronSettings, OptimConfig


class MasterAdamW:
    """torch AdamW over fp32 master copies of (bf16) params, global-norm grad clipping."""

    def __init__(self, params: list[torch.nn.Parameter], optim: OptimConfig):
        self.params = params
        self.master = [p.detach().float().clone() if p.dtype != torch.float32 else p for p in params]
        for m in self.master:
            m.requires_grad_(True)
        self.grad_clip = optim.grad_clip
        self.inner = torch.optim.AdamW(
            self.master, lr=optim.lr, weight_decay=optim.weight_decay, betas=(optim.adam_beta1, optim.adam_beta2)
        )

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for m in self.master:
            m.grad = None

    def step(self) -> float:
        for p, m in zip(self.params, self.master):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
        norm = torch.nn.utils.clip_grad_norm_(self.master, self.grad_clip)
        if not torch.isfinite(norm):
            return float(norm)  # a NaN/inf gradient never reaches the weights (nor Adam's moments)
        self.inner.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                if m is not p:
                    p.copy_(m)
        return float(norm)

    def state_dict(self) -> dict:
        return {"master": [m.detach() for m in self.master], "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for m, saved in zip(self.master, state["master"]):
                m.copy_(saved)
            for p, m in zip(self.params, self.master):
                if m is not p:
                    p.copy_(m)
        self.inner.load_state_dict(state["inner"])


def build_megatron_optimizer(
    chunks: list[torch.nn.Module], settings: MegatronSettings, optim: OptimConfig, dtype: torch.dtype
) -> tuple[list, Any, Any]:
    """Megatron's DistributedDataParallel around each model chunk, its optimizer and its LR scheduler (warmup +
    decay): (ddps, optimizer, scheduler). Wires the chunks' configs so Megatron's schedule syncs and reduces
    grads through those DDPs."""
    # optional dependency: imported on use
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    s = settings
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=s.overlap_grad_reduce,
        overlap_param_gather=s.overlap_param_gather,
        use_distributed_optimizer=s.use_distributed_optimizer,
    )
    # Bucketing (overlap) only on the first chunk, as Megatron-LM does with interleaved stages.
    ddps = [
        DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]
    ddp = ddps[0]
    for chunk in chunks:
        # The schedule reduces grads (DP average, tied-embedding and sequence-parallel norm grads) at its end.
        chunk.config.finalize_model_grads_func = finalize_model_grads
        chunk.config.no_sync_func = ddp.no_sync if len(ddps) == 1 else [d.no_sync for d in ddps]
        if s.overlap_param_gather:
            chunk.config.param_sync_func = (
                ddp.start_param_sync if len(ddps) == 1 else [d.start_param_sync for d in ddps]
            )
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=s.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=1e-8,
        clip_grad=optim.grad_clip,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=s.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, ddps)
    decay_steps = s.lr_warmup_steps + (s.lr_decay_steps or 1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if s.lr_warmup_steps else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.lr if s.lr_decay_style == "constant" else s.min_lr,
        lr_warmup_steps=s.lr_warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=s.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
    return ddps, optimizer, scheduler


def inner_optimizers(optimizer) -> list:
    """The torch optimizers inside Megatron's (chained) optimizer: they hold the Adam state and, in mixed
    precision, the fp32 master copies."""
    outer = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [o.optimizer for o in outer if getattr(o, "optimizer", None) is not None]
