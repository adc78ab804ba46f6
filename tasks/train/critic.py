"""The critic of `advantage_estimator="ppo"`: a value-head model, its clipped value loss, its optimizer loop.

The critic is the policy's base model (same path, its own copy) without the LM head, plus a linear head
giving one value per position. It lives in its own actor (`critic_worker.py`) beside the policy trainer:
per rollout it scores the old values, turns them into GAE advantages and returns
(`advantages.gae_advantages`), hands those to the trainer, then fits its values to the returns.

Layout as `TrainBatch`: values are target aligned [B, L-1]; column j is the value of the state that
predicts token j + 1 (the prompt and the response so far), so a response token's value sits on the same
column as its log-prob and advantage.
"""

from __future__ import annotations

import dataclasses
import io

import torch

from rollflow.tasks.train.batch import TrainBatch
from rollflow.tasks.train.objective import Denominators, minibatch_steps
from rollflow.tasks.train.settings import AlgoConfig, OptimConfig


@dataclasses.dataclass
class CriticEstimate:
    """What the critic hands the policy trainer for one rollout: dense [B, L-1] float32 tensors in the
    rollout's sample order, 0 outside the loss mask. `advantages` are whitened, `returns` are not."""

    values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, value_clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss (PPO2 / slime / verl) and where the clipped branch is the larger one.

        V_clip = V_old + clamp(V - V_old, -value_clip, value_clip)
        loss   = 0.5 * max((V - R)^2, (V_clip - R)^2)
        clipped = (V_clip - R)^2 > (V - R)^2

    The max makes the clip pessimistic: a prediction that moved more than `value_clip` away from the old
    value gets no gradient toward the return beyond the clip. Computed in float32 at least (bf16 inputs
    are upcast), so the squares neither round to 0 nor overflow in half precision.
    """
    if not (values.shape == old_values.shape == returns.shape):
        raise ValueError(
            f"values {tuple(values.shape)}, old_values {tuple(old_values.shape)} and returns "
            f"{tuple(returns.shape)} differ in shape"
        )
    if value_clip <= 0:
        raise ValueError(f"value_clip must be > 0, got {value_clip}")
    dtype = torch.promote_types(values.dtype, torch.float32)
    v, old, ret = values.to(dtype), old_values.to(dtype), returns.to(dtype)
    v_clipped = old + (v - old).clamp(-value_clip, value_clip)
    unclipped_loss = (v - ret).square()
    clipped_loss = (v_clipped - ret).square()
    return 0.5 * torch.maximum(unclipped_loss, clipped_loss), clipped_loss > unclipped_loss


def masked_token_mean(values: torch.Tensor, mask: torch.Tensor, denom: float) -> torch.Tensor:
    # where, not values * mask: a non-finite value on a masked-out token must not poison the sum
    return torch.where(mask > 0, values, torch.zeros_like(values)).sum() / denom


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over masked-in tokens: 1 = the critic predicts the returns, 0 = no better than
    their mean, < 0 = worse. 0 when the returns do not vary."""
    on = mask > 0
    if int(on.sum()) < 2:
        return 0.0
    r, v = returns[on].double(), values[on].double()
    var_r = r.var()
    return 0.0 if var_r == 0 else float(1.0 - (r - v).var() / var_r)


class ValueModel(torch.nn.Module):
    """A causal LM's decoder (its `base_model`, LM head dropped) + a linear value head."""

    def __init__(self, causal_lm: torch.nn.Module):
        super().__init__()
        self.backbone = causal_lm.base_model
        param = next(self.backbone.parameters())
        self.value_head = torch.nn.Linear(causal_lm.config.hidden_size, 1, dtype=param.dtype, device=param.device)
        # Zero init: every value starts at 0, the critic of "no information", instead of random noise that
        # GAE would then add to the first advantages.
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, batch: TrainBatch) -> torch.Tensor:
        """Target-aligned values [B, L-1], float32, on the model's device."""
        device = self.value_head.weight.device
        hidden = self.backbone(
            input_ids=batch.tokens.to(device, torch.long),
            attention_mask=batch.attention_mask.to(device),
            position_ids=batch.position_ids.to(device),
        ).last_hidden_state
        return self.value_head(hidden[:, :-1]).squeeze(-1).float()


class CriticBackend:
    """The value model and its AdamW (lr = algo.critic_lr; betas, weight decay, grad clip, steps per rollout
    and micro-batch size are the policy's train.*), on one process (torch backend only)."""

    name = "torch-critic"

    def __init__(self, causal_lm: torch.nn.Module, optim: OptimConfig, algo: AlgoConfig):
        torch.set_num_threads(optim.threads)
        torch.manual_seed(optim.seed)
        self.optim_cfg, self.algo = optim, algo
        self.model = ValueModel(causal_lm).eval()  # eval(): no dropout; scoring and training forwards agree
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=algo.critic_lr,
            weight_decay=optim.weight_decay,
            betas=(optim.adam_beta1, optim.adam_beta2),
        )

    @property
    def vocab_size(self) -> int | None:
        """The backbone's HF config's vocabulary size (None: its config does not say)."""
        value = getattr(self.model.backbone.config, "vocab_size", None)
        return value if isinstance(value, int) else None

    @torch.no_grad()
    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """Old values [B, L-1] with the training forward's micro-batch split (the same numerics)."""
        size = self.optim_cfg.micro_batch_size
        return torch.cat([self.model(batch.select(slice(i, i + size))).cpu() for i in range(0, batch.size, size)])

    def train(self, batch: TrainBatch) -> dict[str, float]:
        """Value-loss steps on `batch` (with `values` = old values and `returns`); `critic/*` metrics."""
        if batch.values is None or batch.returns is None:
            raise ValueError("the critic trains on a batch with old values and returns (CriticWorker.estimate)")
        clip = self.algo.value_clip

        def micro_step(micro: TrainBatch, denom: Denominators) -> dict[str, float]:
            values = self.model(micro)
            old, returns, mask = (t.to(values.device) for t in (micro.values, micro.returns, micro.response_mask))
            loss_per_token, clipped = value_loss(values, old, returns, clip)
            loss = masked_token_mean(loss_per_token, mask, denom.tokens)
            loss.backward()
            return {
                "loss": float(loss.detach()),
                "vf_clipfrac": float(masked_token_mean(clipped.float(), mask, denom.tokens)),
            }

        def optimizer_step() -> float:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_cfg.grad_clip)
            self.optimizer.step()
            return float(grad_norm)

        stats = minibatch_steps(
            batch,
            self.optim_cfg.num_steps_per_rollout,
            self.optim_cfg.micro_batch_size,
            zero_grad=lambda: self.optimizer.zero_grad(set_to_none=True),
            micro_step=micro_step,
            optimizer_step=optimizer_step,
        )
        mask = batch.response_mask
        tokens = max(float(mask.sum()), 1.0)
        return {
            "critic/value_loss": stats.get("train/loss", 0.0),
            "critic/vf_clipfrac": stats.get("train/vf_clipfrac", 0.0),
            "critic/grad_norm": stats.get("train/grad_norm", 0.0),
            "critic/values": float(masked_token_mean(batch.values, mask, tokens)),
            "critic/returns": float(masked_token_mean(batch.returns, mask, tokens)),
            "critic/explained_variance": explained_variance(batch.values, batch.returns, mask),
        }

    def checkpoint_bytes(self) -> bytes:
        buf = io.BytesIO()
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, buf)
        return buf.getvalue()

    def load_checkpoint_bytes(self, data: bytes) -> None:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)  # data, never code
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
