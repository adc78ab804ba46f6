"""The `hf` rollout engine: batched sampling with transformers' `generate` (CPU default, small GPUs).

With a static cache (on CUDA by default) it runs its own decode loop over transformers' static KV
cache (tasks/rollout/static_decode.py: the compiled one-token step that `generate` uses, Gumbel-max
sampling and log-probs on the device, no per-token host synchronisation); top-k / top-p sampling and
the dynamic cache (CPU default) go through `generate`. A compiled step is specialised to its shapes, so
prompt widths are padded up to a multiple of `length_bucket` and batches up to a power of two (extra
rows are dropped): a rollout then recompiles for few distinct shapes only.

Log-probs: by default those of the sampling steps themselves (~1e-5 off the trainer's in fp32). With a
`ScoringLayout` (rollout.logprobs='teacher_forced') the engine rescores every call's samples after
sampling with the trainer's own forward (tasks/model/teacher_forced.py: one right-padded batch of all
samples in request order, the trainer's micro-batch size, dtype and thread count), so the rollout
log-probs are bitwise the trainer's old log-probs; the price is one extra forward over the rollout.

Seeds: one `torch.manual_seed(params.seed)` per call, then every row (every sample of a group) draws
from the same RNG stream, so the samples of a group differ; never reseed per sample with one seed.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import threading
from typing import Literal, Sequence, Union

import torch

from rollflow.tasks.model.dtypes import DTYPES
from rollflow.tasks.model.routing import decode_routes, padded_routes, record_routes, route_shape
from rollflow.tasks.model.teacher_forced import ScoringLayout, right_padded, teacher_forced_log_probs
from rollflow.tasks.pinned import HostShelf, bring_back, park_on_host
from rollflow.tasks.progress import Progress
from rollflow.tasks.rollout.engine import GenerationOutput, GenerationRequest, SamplingParams, next_weight_version
from rollflow.tasks.rollout.static_decode import StaticDecoder
from rollflow.tasks.sync.bucket_update import BucketedUpdate
from rollflow.tasks.sync.copy_plan import MEMCPY_BYTES, CopyPlan, plan_key, run_plan
from rollflow.tasks.sync.ipc import FLATTENED_BUCKET, deserialize_named_tensors
from rollflow.tasks.sync.resident import ResidentWeights

StaticCache = Union[bool, Literal["auto"]]
WeightSync = Literal["object_store", "tensor"]
_MEMCPY_BYTES = MEMCPY_BYTES  # (a name the tests patch) tensors this large are copied one by one
# Plans kept: a device-resident path keeps its plan while a host-staged update (new host copies each
# time, so a new key) comes between two of its calls.
_KEPT_PLANS = 4


class _StepLogProbs:
    """A logits processor that keeps only the sampled token's log-prob of each step.

    At step t it sees the token chosen at step t-1 (the last column of `input_ids`), so it holds one
    step's log-softmax at a time instead of every step's full-vocabulary logits (`output_logits`
    keeps batch x steps x vocab floats: 40 GB for 256 x 256 tokens of a 152k vocabulary).
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.done: list[torch.Tensor] = []
        self.pending: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            self.done.append(self.pending.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """[B, T] log-probs of `new_tokens` (generate may run steps it then undoes: those are cut)."""
        steps = new_tokens.shape[1]
        cols = self.done[:steps]
        if len(cols) < steps and self.pending is not None:
            cols.append(self.pending.gather(-1, new_tokens[:, len(cols) : len(cols) + 1]).squeeze(-1))
        if len(cols) != steps:
            raise RuntimeError(f"log-prob recorder saw {len(cols)} steps for {steps} generated tokens")
        return torch.stack(cols, dim=1)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class HFEngine:
    def __init__(
        self,
        model,
        *,
        pad_token_id: int,
        eos_token_id: int,
        model_name: str = "model",
        weight_version: int = 0,
        max_batch_size: int = 4096,
        threads: int | None = None,
        static_cache: StaticCache = "auto",
        length_bucket: int = 64,
        scoring: ScoringLayout | None = None,
        record_routes: bool = False,
        weight_sync: WeightSync = "object_store",
    ):
        if threads:
            torch.set_num_threads(threads)
        self.model = model.eval()
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.model_name = model_name
        self.weight_version = weight_version
        self.max_batch_size = max_batch_size
        if static_cache not in (True, False, "auto"):
            raise ValueError(f"rollout.static_cache={static_cache!r}: expected true, false or 'auto'")
        self.static_cache = static_cache
        self.length_bucket = max(1, int(length_bucket))
        self.scoring = scoring
        self.resident = ResidentWeights(self.model)
        # Recent updates' copies by key (sources / destinations / shapes), reused while a key holds.
        self._copy_plans: dict[tuple, CopyPlan] = {}
        self._host_shelf = HostShelf()  # pinned buffers the weights are parked in (release_memory)
        self._decoder: StaticDecoder | None = None
        if weight_sync not in ("object_store", "tensor"):
            raise ValueError(f"rollout.hf_weight_sync={weight_sync!r}: expected object_store or tensor")
        # How the trainer's weights come (flows/weight_sync/): a whole dict (object_store), or bucket by bucket as
        # the trainer makes them on its GPU (tensor: CUDA IPC handles from another actor, no host staging).
        self.weight_sync = weight_sync
        self.payloads_per_bucket = 1
        self._bucketed: BucketedUpdate | None = None
        if scoring is not None:
            check_scoring(self.model, scoring)
        # MoE routing replay: every output carries its top-k expert ids per layer (algo.routing_replay).
        self.route_shape = route_shape(self.model) if record_routes else None
        # Set from another thread (the actor's control group) to cut a running generate short: partial rollouts.
        self._abort = threading.Event()
        # Decode steps done, read from the control group: a stall deadline tells a long rollout from a stuck one.
        self.progress = Progress()

    @property
    def uses_static_cache(self) -> bool:
        """`auto`: on for CUDA, where transformers compiles the static-cache decode step; off elsewhere."""
        if self.static_cache == "auto":
            return self.device.type == "cuda"
        return bool(self.static_cache)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def describe(self) -> dict[str, str]:
        return {
            "backend": "hf",
            "model": self.model_name,
            "weight_version": str(self.weight_version),
            "logprobs": "engine" if self.scoring is None else "teacher_forced",
        }

    def generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[list[GenerationOutput]]:
        if params.seed is not None:
            torch.manual_seed(params.seed)
        flat: list[list[int]] = [r.prompt_ids for r in requests for _ in range(r.n)]
        outputs: list[GenerationOutput] = []
        for start in range(0, len(flat), self.max_batch_size):
            outputs.extend(self._generate_batch(flat[start : start + self.max_batch_size], params))
        if self.scoring is not None and outputs:
            outputs = self.rescore(flat, outputs, params)
        grouped, pos = [], 0
        for r in requests:
            grouped.append(outputs[pos : pos + r.n])
            pos += r.n
        return grouped

    def abort(self, rids: list[str] | None = None) -> int:
        """Stop the running generate after its current step (and any later call until `reset_abort`): rows
        that have not finished come back with finish_reason "abort" and their tokens so far."""
        self._abort.set()
        return 1

    def reset_abort(self) -> None:
        self._abort.clear()

    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationOutput]:
        n_real = len(prompts)
        if self._abort.is_set():
            return [GenerationOutput([], [], "abort") for _ in range(n_real)]
        width = max(len(p) for p in prompts)
        static = self.uses_static_cache
        if static:
            # Few distinct shapes -> few compilations: widths to a bucket, batches to a power of two.
            width = _round_up(width, self.length_bucket)
            rows = min(1 << (n_real - 1).bit_length(), max(self.max_batch_size, n_real))
            prompts = prompts + [prompts[-1]] * (rows - n_real)
        # Left padding: every prompt ends at the same column, so new tokens line up.
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p) :] = 1
        stops = [self.eos_token_id, *params.stop_token_ids]
        greedy = params.temperature == 0
        scale = 1.0 if greedy else params.temperature
        if static and self.route_shape is not None:
            raise ValueError(
                "algo.routing_replay=true records routes in transformers' generate only; set rollout.static_cache=false"
            )
        if static and (greedy or (params.top_k == 0 and params.top_p == 1.0)):
            decoded = self._static_decoder().run(
                ids.to(self.device),
                mask.to(self.device),
                max_new_tokens=params.max_new_tokens,
                temperature=params.temperature,
                stop_ids=stops,
                pad_id=self.pad_token_id,
                abort=self._abort,
                progress=self.progress,
            )
            return _outputs(decoded.tokens, decoded.log_probs, n_real, set(stops), aborted=decoded.aborted)
        # On CPU the log-probs come from `output_logits` (unchanged numerics); elsewhere from a
        # recorder that keeps one step of full-vocabulary log-probs at a time, on the device.
        recorder = None if self.device.type == "cpu" else _StepLogProbs(scale)
        extra = {"cache_implementation": "static"} if static else {}
        extra["stopping_criteria"] = _abort_criteria(self._abort, self.progress)
        if recorder is not None:
            from transformers import LogitsProcessorList

            extra["logits_processor"] = LogitsProcessorList([recorder])
        recording = record_routes(self.model) if self.route_shape is not None else contextlib.nullcontext()
        with recording as calls:
            out = self._sample(ids, mask, params, greedy, stops, recorder, extra)
        routes = None if calls is None else decode_routes(calls, len(prompts))
        if recorder is None:
            new_tokens = out.sequences[:, width:].cpu()
            logits = torch.stack(out.logits, dim=1).float().cpu()  # raw logits, before any processor
            log_probs = torch.log_softmax(logits / scale, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        else:
            new_dev = out.sequences[:, width:]
            log_probs = recorder.finish(new_dev).cpu()
            new_tokens = new_dev.cpu()
        # Stopped before the budget by an abort (not by every row finishing): unfinished rows are aborted.
        aborted = self._abort.is_set() and new_tokens.shape[1] < params.max_new_tokens
        outputs = _outputs(new_tokens, log_probs, n_real, set(stops), aborted=aborted)
        if routes is None:
            return outputs
        return [_with_routes(o, routes[row], width, len(p)) for row, (o, p) in enumerate(zip(outputs, prompts))]

    def _sample(self, ids, mask, params: SamplingParams, greedy: bool, stops: list[int], recorder, extra):
        return self.model.generate(
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
            output_logits=recorder is None,
            **extra,
        )

    def _static_decoder(self) -> StaticDecoder:
        if self._decoder is None:
            self._decoder = StaticDecoder(self.model, compile=self.device.type == "cuda")
        return self._decoder

    def rescore(
        self, prompts: list[list[int]], outputs: list[GenerationOutput], params: SamplingParams
    ) -> list[GenerationOutput]:
        """`outputs` with log-probs from the trainer's teacher-forced forward over all of them at once.

        The trainer's batch of this rollout is these rows in this order (generate_samples keeps request
        order, the artifact keeps sample order), so padding width and micro-batch boundaries match too.
        """
        layout = self.scoring
        assert layout is not None
        padded = right_padded([list(p) + list(o.response_ids) for p, o in zip(prompts, outputs)])
        # The trainer divides by rollout.temperature (1.0 when greedy), as the sampling steps do.
        temperature = params.temperature if params.temperature > 0 else 1.0
        threads = torch.get_num_threads()
        if self.device.type == "cpu":
            torch.set_num_threads(layout.threads)  # CPU reductions may split by thread count
        routes = None
        if self.route_shape is not None:
            per_sample = [o.routes for o in outputs]
            routes = padded_routes(per_sample, padded.tokens.shape[1], self.route_shape)  # type: ignore[arg-type]
        try:
            log_probs = teacher_forced_log_probs(
                self.model,
                padded.tokens,
                padded.attention_mask,
                padded.position_ids,
                temperature=temperature,
                micro_batch_size=layout.micro_batch_size,
                routes=routes,
            )
        finally:
            torch.set_num_threads(threads)
        rescored = []
        for row, (prompt, out) in enumerate(zip(prompts, outputs)):
            start = len(prompt) - 1  # the column that predicts the first response token
            values = log_probs[row, start : start + len(out.response_ids)].tolist()
            rescored.append(dataclasses.replace(out, log_probs=values))
        return rescored

    def update_weights(self, named_tensors: dict[str, torch.Tensor], weight_version: int) -> None:
        version = next_weight_version(self.weight_version, weight_version)
        targets = self.resident.tensors()
        if named_tensors.keys() != targets.keys():
            missing = sorted(set(targets) - set(named_tensors))
            unexpected = sorted(set(named_tensors) - set(targets))
            raise KeyError(
                f"weight update does not match the engine's parameters: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]} (check the trainer->engine name mapping)"
            )
        dst, src = list(targets.values()), list(map(named_tensors.__getitem__, targets))
        key = plan_key(dst, src)
        plan = self._copy_plans.pop(key, None) or self._plan_update(targets, named_tensors, key)
        self._copy_plans[key] = plan  # most recent last
        while len(self._copy_plans) > _KEPT_PLANS:
            self._copy_plans.pop(next(iter(self._copy_plans)))
        run_plan(plan, dst, src)  # the same sources at the same addresses as before: checks done then
        self.weight_version = version

    def _plan_update(
        self, targets: dict[str, torch.Tensor], named_tensors: dict[str, torch.Tensor], key: tuple
    ) -> CopyPlan:
        for name, d in targets.items():
            if d.shape != named_tensors[name].shape:
                raise ValueError(
                    f"weight update: {name} has shape {tuple(named_tensors[name].shape)}, engine "
                    f"expects {tuple(d.shape)}"
                )
        # A tied parameter is written once, when the trainer sends the same tensor under both names.
        skip = {
            name
            for name, first in self.resident.aliases().items()
            if named_tensors[name] is named_tensors[first]
            or named_tensors[name].data_ptr() == named_tensors[first].data_ptr()
        }
        return CopyPlan(key, tuple(i for i, name in enumerate(targets) if name not in skip), _MEMCPY_BYTES)

    # -- bucket by bucket (weight_sync=tensor; flows/weight_sync/tensor.py drives it) ---------------------
    def begin_weight_update(self) -> None:
        """A new bucketed sync: whatever an earlier one left unfinished (its trainer failed) is forgotten."""
        self._bucketed = None

    def end_weight_update(self) -> None:
        self._bucketed = None

    def apply_bucket(self, named: Sequence[tuple[str, torch.Tensor]], *, last: bool, weight_version: int) -> None:
        """Copy one bucket of the trainer's HF-named tensors into the weights; the last one sets `weight_version`,
        provided every weight was written (else KeyError naming the missing ones, and the version stays)."""
        if self._bucketed is None:
            next_weight_version(self.weight_version, weight_version)  # a skipped or repeated sync writes nothing
            self._bucketed = BucketedUpdate(self.resident.tensors(), self.resident.aliases())
        update = self._bucketed
        try:
            update.apply(named)
        except Exception:
            self._bucketed = None
            raise
        if not last:
            return
        self._bucketed = None
        missing = update.missing()
        if missing:
            raise KeyError(
                f"weight update ended with {len(missing)} of the engine's weights never sent ({missing[:5]}): the "
                f"engine keeps weight_version {self.weight_version} (check the trainer->engine name mapping)"
            )
        self.weight_version = next_weight_version(self.weight_version, weight_version)

    def apply_serialized_bucket(
        self, payloads: Sequence[str], *, last: bool, weight_version: int, load_format: str | None = None
    ) -> None:
        """One bucket as the trainer serialized it (tasks/sync/ipc.py: CUDA tensors as IPC handles to the trainer's
        memory, others by value), one payload (this engine has one rank)."""
        if len(payloads) != 1:
            raise ValueError(f"the hf engine takes one payload per bucket, got {len(payloads)}")
        if load_format not in (None, FLATTENED_BUCKET):
            raise ValueError(f"load_format={load_format!r}: the hf engine reads {FLATTENED_BUCKET} or named tensors")
        named = deserialize_named_tensors(base64.b64decode(payloads[0]))
        self.apply_bucket(named, last=last, weight_version=weight_version)
        if self.device.type == "cuda":
            # The trainer frees this bucket once the call returns: the copies out of its memory must be done.
            torch.cuda.current_stream(self.device).synchronize()

    def named_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """The weights where they live (no host copy; Parameters themselves, read-only), for device checksums."""
        return self.resident.tensors()

    # -- colocation: the same sequence as SGLang's memory saver ------------------------------------
    def release_memory(self, tags=None) -> None:
        """Colocation, before training: the weights to pinned host memory and the static KV caches' memory freed
        (`tags` as SGLang's: weights, kv_cache; None = both), then the CUDA cache emptied so another process (the
        trainer actor) can have it. On CPU the weights are already there and stay."""
        tags = {"weights", "kv_cache"} if tags is None else set(tags)
        if "kv_cache" in tags and self._decoder is not None:
            self._decoder.release_caches()
        device = self.device
        if "weights" in tags and device.type != "cpu":
            self._home_device = device
            if device.type == "cuda":
                park_on_host(self.model, self._host_shelf)  # pinned, reused: at the bus's speed
            else:
                self.model.to("cpu")
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def resume_memory(self, tags=None) -> None:
        """Colocation, after training: the weights back on their device. A released KV cache comes back when the
        next generate takes it (only the shape it needs), so `kv_cache` asks for nothing here."""
        if tags is not None and "weights" not in tags:
            return
        home = getattr(self, "_home_device", None)
        if home is not None:
            if home.type == "cuda":
                bring_back(self.model, home)
            else:
                self.model.to(home)
            self._home_device = None

    def kv_cache_bytes(self) -> int:
        """Memory the static KV caches hold now (0 after `release_memory`, until a generate takes one back)."""
        return self._decoder.cache_bytes() if self._decoder is not None else 0


def _outputs(
    new_tokens: torch.Tensor, log_probs: torch.Tensor, n_real: int, stop_set: set[int], *, aborted: bool = False
) -> list[GenerationOutput]:
    """Rows cut after their first stop token (kept: the trainer scores it); padding rows dropped. With
    `aborted`, rows that did not stop are "abort" (continued in a later rollout) instead of "length"."""
    results = []
    for toks, lps in zip(new_tokens[:n_real].tolist(), log_probs[:n_real].tolist()):
        end = next((i + 1 for i, t in enumerate(toks) if t in stop_set), None)
        finish = "stop" if end is not None else "abort" if aborted else "length"
        end = end if end is not None else len(toks)
        results.append(GenerationOutput(toks[:end], lps[:end], finish))
    return results


def _with_routes(out: GenerationOutput, routes: torch.Tensor, width: int, prompt_len: int) -> GenerationOutput:
    """`out` with its row's routes: from its first prompt column (left padding) through its second-to-last
    token, the positions a teacher-forced forward of prompt + response feeds in."""
    start = width - prompt_len
    rows = routes[start : width + len(out.response_ids) - 1] if out.response_ids else routes[start:start]
    return dataclasses.replace(out, routes=rows.numpy().copy())


def _abort_criteria(event: threading.Event, progress: Progress | None = None):
    """A stopping criterion that ends generation for every row once `event` is set (asked once per decode
    step, so it also counts the steps into `progress`)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _Abort(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
            if progress is not None:
                progress.tick()
            return torch.full((input_ids.shape[0],), event.is_set(), dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([_Abort()])


def check_scoring(model, layout: ScoringLayout) -> None:
    """The engine can only reproduce the trainer's log-probs bit for bit with the trainer's dtype and device."""
    param = next(model.parameters())
    if param.dtype != DTYPES[layout.dtype]:
        raise ValueError(
            f"rollout.logprobs='teacher_forced': the engine's model is {str(param.dtype).removeprefix('torch.')} "
            f"but the trainer scores in train.dtype={layout.dtype!r}; set rollout.dtype={layout.dtype!r}"
        )
    if param.device.type != torch.device(layout.device).type:
        raise ValueError(
            f"rollout.logprobs='teacher_forced': the engine runs on {param.device.type} but the trainer "
            f"on train.device={layout.device!r}; put both on the same device type"
        )
