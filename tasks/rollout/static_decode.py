"""The `hf` engine's own decode loop over transformers' static KV cache.

Why not `model.generate(cache_implementation="static")`: at rollout batch sizes its decode step is
bound by the host, not the GPU. Each step rebuilds the model inputs and the 4-D mask, runs the logits
processors and the stopping criteria in Python, and reads `unfinished.max()` back to the host (one
synchronisation per token). This loop keeps everything a step needs on the device in fixed-shape
buffers: the mask is written once for the whole call (left padding + every future column), the
positions are `prompt length + step`, the tokens and log-probs go into preallocated [B, T] tensors,
and the host looks at the finished flags once every `check_every` steps.

Sampling is the Gumbel-max form of the softmax draw: argmax(logits / T - log E), E ~ Exp(1), the
same distribution as `multinomial(softmax(logits / T))`; the log-prob of the drawn token is
`logits/T [token] - logsumexp(logits / T)` in fp32, what the trainer scores. top-k / top-p are not
handled here: the engine takes `generate` for those.

On CUDA the one-token step is transformers' compiled call of the model (`get_compiled_call`: the same
torch.compile + CUDA graphs that `generate` uses) and the sampler is compiled too. Caches are kept per
(batch, length) shape, so the warm-up (compilation) is paid once per shape per engine and reused by
every later rollout; a colocated engine frees their memory while the trainer trains (`release_caches`).
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from collections import OrderedDict

import torch

from rollflow.tasks.progress import Progress

MAX_CACHED_SHAPES = 4


@dataclasses.dataclass
class Decoded:
    tokens: torch.Tensor  # [B, steps] int64 on the host; rows that stopped are padded after their stop token
    log_probs: torch.Tensor  # [B, steps] float32 on the host; 0 after a row's stop token
    aborted: bool = False  # cut short by `abort` before the budget (unfinished rows are partial)


def _sample(logits: torch.Tensor, temperature: float, greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    scaled = logits.float() / temperature
    lse = torch.logsumexp(scaled, dim=-1)
    if greedy:
        token = scaled.argmax(dim=-1)
    else:
        token = (scaled - torch.empty_like(scaled).exponential_().log()).argmax(dim=-1)
    return token, scaled.gather(-1, token[:, None]).squeeze(-1) - lse


def _new_static_cache(model, batch: int, length: int):
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    kwargs = {"config": model.config, "max_cache_len": length}
    param = next(model.parameters())
    # Older transformers releases size the cache up front; newer ones lazily from the first update.
    for name, value in (
        ("max_batch_size", batch),
        ("batch_size", batch),
        ("device", param.device),
        ("dtype", param.dtype),
    ):
        if name in params:
            kwargs[name] = value
    return StaticCache(**kwargs)


def cache_tensors(cache) -> list[torch.Tensor]:
    """The K / V tensors a transformers StaticCache has allocated (newer releases allocate each layer's lazily, at
    its first update; older ones keep `key_cache` / `value_cache` lists)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        pairs = [(getattr(layer, "keys", None), getattr(layer, "values", None)) for layer in layers]
    else:
        pairs = list(zip(getattr(cache, "key_cache", ()), getattr(cache, "value_cache", ())))
    return [t for pair in pairs for t in pair if isinstance(t, torch.Tensor)]


def _full_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()  # a cache tensor is its whole storage, from offset 0


class StaticDecoder:
    def __init__(self, model, *, compile: bool, check_every: int = 8):
        self.model = model
        self.compile = compile
        self.check_every = max(1, int(check_every))
        self._caches: OrderedDict[tuple[int, int], object] = OrderedDict()
        self._sampler = torch.compile(_sample, dynamic=False) if compile else _sample
        forward = inspect.signature(model.forward).parameters
        self._takes_cache_position = "cache_position" in forward
        self._takes_logits_to_keep = "logits_to_keep" in forward

    def _cache(self, batch: int, length: int):
        key = (batch, length)
        cache = self._caches.pop(key, None)
        if cache is None:
            cache = _new_static_cache(self.model, batch, length)
            while len(self._caches) >= MAX_CACHED_SHAPES:
                self._caches.popitem(last=False)
        else:
            for t in cache_tensors(cache):  # released for a colocated trainer: the memory back, zeroed by reset
                if t.untyped_storage().nbytes() < _full_bytes(t):
                    t.untyped_storage().resize_(_full_bytes(t))
            cache.reset()
        self._caches[key] = cache
        return cache

    def release_caches(self) -> int:
        """Free the memory of every kept KV cache (colocation: the trainer trains in it); bytes freed. The tensor
        objects stay: transformers marks them static addresses for the compiled step, which a new cache object
        would recompile for, while a storage that comes back at another address only has its CUDA graph
        re-recorded (as when the weights come back from the host). Each comes back when a call next takes it."""
        freed = 0
        for cache in self._caches.values():
            for t in cache_tensors(cache):
                storage = t.untyped_storage()
                freed += storage.nbytes()
                storage.resize_(0)
        return freed

    def cache_bytes(self) -> int:
        """Memory the kept KV caches hold now."""
        return sum(t.untyped_storage().nbytes() for c in self._caches.values() for t in cache_tensors(c))

    def _step_fn(self):
        if self.compile:
            return self.model.get_compiled_call(None)
        return self.model.__call__

    @torch.no_grad()
    def run(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        *,
        max_new_tokens: int,
        temperature: float,
        stop_ids: list[int],
        pad_id: int,
        abort: threading.Event | None = None,
        progress: Progress | None = None,
    ) -> Decoded:
        """`ids`/`mask`: [B, W] left-padded prompts on the model's device. `abort`, set from another
        thread, ends the loop after the current step (partial rollouts). `progress` counts the decode steps."""
        batch, width = ids.shape
        device = ids.device
        total = width + max_new_tokens
        cache = self._cache(batch, total)
        greedy = temperature == 0
        temp = 1.0 if greedy else float(temperature)
        # Every future column is attended to once it is written; causality hides it before that.
        full_mask = torch.ones((batch, total), dtype=mask.dtype, device=device)
        full_mask[:, :width] = mask
        prompt_len = mask.sum(dim=-1)
        positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
        stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
        tokens = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
        log_probs = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)
        done = torch.zeros(batch, dtype=torch.bool, device=device)

        extra = {"logits_to_keep": 1} if self._takes_logits_to_keep else {}
        if self._takes_cache_position:
            extra["cache_position"] = torch.arange(width, device=device)
        out = self.model(
            input_ids=ids,
            attention_mask=full_mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            **extra,
        )
        logits = out.logits[:, -1]
        step = self._step_fn()
        steps, aborted = max_new_tokens, False
        for t in range(max_new_tokens):
            token, lp = self._sampler(logits, temp, greedy)
            tokens[:, t] = torch.where(done, pad_id, token)
            log_probs[:, t] = torch.where(done, 0.0, lp)
            done |= torch.isin(token, stops)
            if progress is not None:
                progress.tick()
            if t + 1 == max_new_tokens:
                break
            if abort is not None and abort.is_set():
                steps, aborted = t + 1, True
                break
            if (t + 1) % self.check_every == 0 and bool(done.all()):
                steps = t + 1
                break
            kwargs = {}
            if self._takes_cache_position:
                kwargs["cache_position"] = torch.full((1,), width + t, dtype=torch.long, device=device)
            out = step(
                input_ids=token[:, None],
                attention_mask=full_mask,
                position_ids=(prompt_len + t)[:, None],
                past_key_values=cache,
                use_cache=True,
                **kwargs,
            )
            logits = out.logits[:, -1]
        return Decoded(tokens[:, :steps].cpu(), log_probs[:, :steps].cpu(), aborted)
