"""The torch backend with a LoRA policy (`model.lora`): the base model frozen, only the adapter trains.

- Reference (ref log-probs, KL): the base model, which is the policy with its adapter switched off; B starts at
  zero, so that is the starting policy, the torch backend's reference, without a second copy of the model.
- Weights out (weight sync, parity, checkpoint NaN guard): merged, HF-named, W + (alpha / r) * B @ A, the
  same names and shapes as without LoRA; the trained adapter is never merged in place. SGLang engines with
  rollout.sglang.lora_sync=adapter take the adapter itself instead (`lora_adapter`: PEFT names + config).
- Checkpoint: the adapter, the optimizer (adapter moments only) and the RNG; the base is `model.path` again.
"""

from __future__ import annotations

import io

import torch

from rollflow.tasks.train.batch import TrainBatch
from rollflow.tasks.train.data_parallel import DataParallel
from rollflow.tasks.train.lora import (
    LORA_FORMAT,
    adapter_config,
    adapter_parameters,
    base_weights,
    lora_dropouts,
    merge_adapter,
    peft_named,
    wrap_lora,
)
from rollflow.tasks.train.settings import LoraSettings, OptimConfig
from rollflow.tasks.train.torch_backend import TorchBackend


class LoraTorchBackend(TorchBackend):
    def __init__(
        self,
        model,
        optim: OptimConfig,
        lora: LoraSettings,
        *,
        temperature: float = 1.0,
        dp: DataParallel | None = None,
    ):
        torch.manual_seed(optim.seed)  # the adapter's A is drawn here: the same start on every run and rank
        self.lora = lora
        super().__init__(wrap_lora(model, lora), optim, temperature=temperature, keep_ref=False, dp=dp)

    @torch.no_grad()
    def compute_log_probs(self, batch: TrainBatch, which: str = "policy") -> torch.Tensor:
        if which == "policy":
            return super().compute_log_probs(batch)
        with self.model.disable_adapter():  # the base model: the starting policy
            return super().compute_log_probs(batch)

    def _gradient_forward_mode(self) -> None:
        super()._gradient_forward_mode()
        for dropout in lora_dropouts(self.model):  # model.lora.dropout acts in the gradient forward only
            dropout.train()

    def _merged(self) -> dict[str, torch.Tensor]:
        adapter = {k: p.detach() for k, p in adapter_parameters(self.model).items()}
        return merge_adapter(base_weights(self.model), adapter, self.lora.scaling)

    def named_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.cpu().clone() for k, v in self._merged().items()}

    def lora_adapter(self) -> dict:
        """What an engine that applies adapters itself takes (rollout.sglang.lora_sync=adapter): the adapter
        tensors under PEFT's saved names, on the host, and PEFT's adapter_config."""
        tensors = {k: p.detach().cpu().clone() for k, p in adapter_parameters(self.model).items()}
        return {"tensors": peft_named(tensors), "config": adapter_config(self.lora)}

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """Merged weights on the trainer's device (adapted ones are new tensors; the rest the base's own)."""
        return self._merged()

    def checkpoint_bytes(self) -> bytes:
        buf = io.BytesIO()
        adapter = {k: p.detach().cpu().clone() for k, p in adapter_parameters(self.model).items()}
        torch.save(
            {
                "format": LORA_FORMAT,
                "lora": self.lora.model_dump(mode="json"),
                "adapter": adapter,
                "optimizer": self.optimizer.state_dict(),
                "rng": torch.get_rng_state(),
            },
            buf,
        )
        return buf.getvalue()

    def load_checkpoint_bytes(self, data: bytes) -> None:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)  # data, never code
        if state.get("format") != LORA_FORMAT:
            raise ValueError(
                "the checkpoint holds full weights (written without model.lora); this trainer has model.lora "
                "set: resume it without model.lora, or start a new run"
            )
        if state["lora"] != self.lora.model_dump(mode="json"):
            raise ValueError(
                f"the checkpoint's adapter was trained with model.lora={state['lora']}; this run has "
                f"model.lora={self.lora.model_dump(mode='json')}: set the checkpoint's values or start a new run"
            )
        params = adapter_parameters(self.model)
        if set(params) != set(state["adapter"]):
            raise ValueError("the checkpoint's adapter tensors do not match this model's (another model.path?)")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(state["adapter"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
