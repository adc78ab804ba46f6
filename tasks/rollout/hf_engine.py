"""The `hf` rollout engine: batched sampling with transformers' `generate` (CPU default, small GPUs)."""

from __future__ import annotations

import torch

from tasks.rollout.engine import GenerationOutput, GenerationRequest, SamplingParams, next_weight_version


class HFEngine:
    def __init__(self, model, *, pad_token_id: int, eos_token_id: int, model_name: str = "model",
                 weight_version: int = 0, max_batch_size: int = 4096, threads: int | None = None):
        if threads:
            torch.set_num_threads(threads)
        self.model = model.eval()
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.model_name = model_name
        self.weight_version = weight_version
        self.max_batch_size = max_batch_size

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def describe(self) -> dict[str, str]:
        return {"backend": "hf", "model": self.model_name, "weight_version": str(self.weight_version)}

    def generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[list[GenerationOutput]]:
        if params.seed is not None:
            torch.manual_seed(params.seed)
        flat: list[list[int]] = [r.prompt_ids for r in requests for _ in range(r.n)]
        outputs: list[GenerationOutput] = []
        for start in range(0, len(flat), self.max_batch_size):
            outputs.extend(self._generate_batch(flat[start : start + self.max_batch_size], params))
        grouped, pos = [], 0
        for r in requests:
            grouped.append(outputs[pos : pos + r.n])
            pos += r.n
        return grouped

    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationOutput]:
        width = max(len(p) for p in prompts)
        # Left padding: every prompt ends at the same column, so new tokens line up.
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p) :] = 1
        stops = [self.eos_token_id, *params.stop_token_ids]
        greedy = params.temperature == 0
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p,
            # transformers treats top_k=None as 50; 0 samples from the full softmax.
            top_k=None if greedy else params.top_k,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=stops,
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
        )
        new_tokens = out.sequences[:, width:].cpu()
        logits = torch.stack(out.logits, dim=1).float().cpu()  # raw logits, before any processor
        scale = 1.0 if greedy else params.temperature
        log_probs = torch.log_softmax(logits / scale, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        results = []
        stop_set = set(stops)
        for row in range(len(prompts)):
            toks = new_tokens[row].tolist()
            end = next((i + 1 for i, t in enumerate(toks) if t in stop_set), None)
            finish = "stop" if end is not None else "length"
            end = end if end is not None else len(toks)
            results.append(GenerationOutput(toks[:end], log_probs[row, :end].tolist(), finish))
        return results

    def update_weights(self, named_tensors: dict[str, torch.Tensor], weight_version: int) -> None:
        version = next_weight_version(self.weight_version, weight_version)
        own = self.model.state_dict()
        missing = sorted(set(own) - set(named_tensors))
        unexpected = sorted(set(named_tensors) - set(own))
        if missing or unexpected:
            raise KeyError(
                f"weight update does not match the engine's parameters: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]} (check the trainer->engine name mapping)"
            )
        with torch.no_grad():
            for name, tensor in named_tensors.items():
                target = own[name]
                if target.shape != tensor.shape:
                    raise ValueError(f"weight update: {name} has shape {tuple(tensor.shape)}, engine expects "
                                     f"{tuple(target.shape)}")
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
        self.weight_version = version

    def named_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
