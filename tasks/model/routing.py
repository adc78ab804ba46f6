"""Rollout routing replay (R3) for MoE models: record the engine's expert choices, force them in the trainer.

An MoE layer sends each token to the top-k experts of its router. The engine (KV cache, left padding,
one token per step) and the trainer (one right-padded forward) compute the router logits on different
shapes, so in bf16 a near tie can pick another expert and the two sides then score a token with
different sub-networks. R3 records, for every input position and MoE layer, the top-k expert ids the
engine chose, and the trainer replays them: its router still computes its logits, but the experts are
the engine's, and the routing weights are the trainer's softmax taken at those experts (renormalised
over them when the model does, as transformers' Qwen3-MoE router does). Gradients then still reach the
router through the chosen experts' logits.

Routes of one sample: an integer array [T - 1, layers, k] for a sample of T tokens (prompt + response):
row i holds the experts that routed token i as input, the one that predicts token i + 1; the last token
is never an input when scoring. That is slime's `rollout_routed_experts` layout too.

Both hooks sit on the router modules (`mlp.gate` of each sparse block) and only for the duration of a
`with` block: nothing stays patched on the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

# Expert ids are stored as int16: more than 127 experts is common (DeepSeek-V3: 256), 32767 is not reached.
ROUTE_DTYPE = np.int16


class RoutesError(ValueError):
    """Routes that cannot be replayed: missing, empty, all zero, or fewer rows than the sample's tokens."""


def moe_routers(model) -> list[torch.nn.Module]:
    """The router of every sparse MoE layer, in layer order (empty for a dense model)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    return [m for m in model.modules() if isinstance(m, Qwen3MoeTopKRouter)]


def route_shape(model) -> tuple[int, int]:
    """(MoE layers, top-k) of `model`: the trailing shape of its routes."""
    routers = moe_routers(model)
    if not routers:
        raise RoutesError("routing replay needs an MoE model; this model has no MoE router")
    return len(routers), int(routers[0].top_k)


@contextlib.contextmanager
def record_routes(model) -> Iterator[list[list[torch.Tensor]]]:
    """Inside the block, every forward appends its top-k ids [rows, k] to the list of each MoE layer
    (rows: the call's batch x sequence positions, flattened row-major as the router sees them)."""
    calls: list[list[torch.Tensor]] = [[] for _ in moe_routers(model)]

    def hook_for(layer: int):
        def hook(module, args, output):
            calls[layer].append(output[2].detach().to("cpu", torch.int16))

        return hook

    handles = [router.register_forward_hook(hook_for(i)) for i, router in enumerate(moe_routers(model))]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def decode_routes(calls: list[list[torch.Tensor]], batch: int) -> torch.Tensor:
    """The recorded calls of one batched generate as [batch, positions, layers, k]: the prefill's columns
    then one column per decode step (each call's rows are batch x its sequence length)."""
    per_layer = [torch.cat([c.view(batch, -1, c.shape[-1]) for c in layer_calls], dim=1) for layer_calls in calls]
    return torch.stack(per_layer, dim=2)


def _forced(module, forced: torch.Tensor, router_logits: torch.Tensor):
    """The router's output with `forced` experts: its softmax at those ids, renormalised as it would."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights = probs.gather(-1, forced)
    if module.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return router_logits, weights.to(router_logits.dtype), forced


@contextlib.contextmanager
def replay_routes(model, routes: torch.Tensor | None) -> Iterator[None]:
    """Inside the block, the next forward of `model` routes with `routes` [B, L, layers, k] (the forward's
    input is [B, L]) instead of its own top-k. `None` leaves routing alone, so callers pass it through."""
    if routes is None:
        yield
        return
    routers = moe_routers(model)
    if routes.shape[2] != len(routers) or routes.shape[3] != routers[0].top_k:
        raise RoutesError(
            f"routes have {routes.shape[2]} MoE layers x top-{routes.shape[3]}, the model "
            f"{len(routers)} x top-{routers[0].top_k if routers else 0}: recorded by another model"
        )

    def hook_for(layer: int):
        def hook(module, args, output):
            router_logits = output[0]
            forced = routes[:, :, layer].reshape(-1, routes.shape[-1]).to(router_logits.device, torch.long)
            if forced.shape[0] != router_logits.shape[0]:
                raise RoutesError(
                    f"routes cover {forced.shape[0]} positions, the forward routes {router_logits.shape[0]}"
                )
            return _forced(module, forced, router_logits)

        return hook

    handles = [router.register_forward_hook(hook_for(i)) for i, router in enumerate(routers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def padded_routes(per_sample: list[np.ndarray], width: int, shape: tuple[int, int]) -> torch.Tensor:
    """Per-sample routes ([T_i - 1, layers, k]) as one right-padded [B, width, layers, k] tensor, the
    layout of the trainer's batch; padding positions route to experts 0..k-1 (they score nothing)."""
    layers, k = shape
    out = torch.arange(k, dtype=torch.int16).expand(len(per_sample), width, layers, k).clone()
    for row, r in enumerate(per_sample):
        out[row, : r.shape[0]] = torch.from_numpy(np.asarray(r, dtype=ROUTE_DTYPE))
    return out


def batch_routes(per_sample: list[np.ndarray | None], n_tokens: list[int], width: int) -> torch.Tensor:
    """The routes of a batch's rows (each checked: `check_routes`) as one right-padded [B, width, layers, k]
    tensor. The layers x k shape is the first row's; every other row must have it."""
    first = per_sample[0] if per_sample else None
    shape = (0, 0) if first is None or first.ndim != 3 else (int(first.shape[1]), int(first.shape[2]))
    for row, (routes, n) in enumerate(zip(per_sample, n_tokens)):
        check_routes(routes, n_tokens=n, shape=shape, where=f"samples[{row}]")
    return padded_routes(per_sample, width, shape)  # type: ignore[arg-type]


def check_routes(routes: np.ndarray | None, *, n_tokens: int, shape: tuple[int, int], where: str) -> None:
    """One sample's routes are replayable: present, [n_tokens - 1, layers, k], not all zero, ids distinct
    per token. Raises `RoutesError` naming `where` and what is wrong."""
    if routes is None or routes.size == 0:
        raise RoutesError(
            f"{where}: routed experts are missing (generated without algo.routing_replay, or by a rollout "
            "function that does not record them); regenerate with algo.routing_replay=true or set it false"
        )
    expected = (n_tokens - 1, *shape)
    if routes.shape != expected:
        raise RoutesError(
            f"{where}: routed experts have shape {tuple(routes.shape)}, expected {expected} "
            f"(one row per input token, layers x top-k): truncated or from another model"
        )
    if not routes.any():
        raise RoutesError(f"{where}: routed experts are all zero (no router ran while recording?)")
    ordered = np.sort(routes, axis=-1)
    if (ordered[..., 1:] == ordered[..., :-1]).any():
        raise RoutesError(f"{where}: routed experts repeat an expert within one token's top-k")


def flatten_routes(routes: np.ndarray) -> np.ndarray:
    """[T - 1, layers, k] -> flat int16 values (a list column's row); the shape goes to metadata."""
    return np.ascontiguousarray(routes, dtype=ROUTE_DTYPE).reshape(-1)


def unflatten_routes(values: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """A list column's row back to [T - 1, layers, k]; a length not a multiple of layers x k is refused."""
    layers, k = shape
    if values.size % (layers * k):
        raise RoutesError(f"routed experts: {values.size} values is not a whole number of {layers} x {k} rows")
    return np.asarray(values, dtype=ROUTE_DTYPE).reshape(-1, layers, k)
