"""SGLang's native HTTP API as pure functions: `/generate` payloads, request ids and responses.

The payload shapes are those of SGLang 0.5.23 (`sglang/srt/managers/io_struct.py`,
`sglang/srt/entrypoints/http_server.py`); `tests/fixtures/sglang_protocol.json` records them with their
sources, and the contract tests check these functions against SGLang's schemas.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from rollflow.tasks.rollout.engine import GenerationOutput, SamplingParams
from rollflow.tasks.sync.ipc import serialize_named_tensors as ipc_serialize

FINISH_TYPES = {"stop": "stop", "length": "length", "abort": "abort"}
# SGLang aborts every request whose rid STARTS WITH the rid given (scheduler.abort_request): ending every
# id with a character used nowhere else in it makes no id a prefix of another.
RID_END = "."


class SGLangRequestError(RuntimeError):
    """An SGLang endpoint answered with an error (or not at all while its process still runs)."""


def sampling_params_payload(params: SamplingParams, *, n: int = 1, seed: int | None = None) -> dict[str, Any]:
    """SGLang `sampling_params`: top_k -1 disables top-k (our 0); temperature 0 is greedy in SGLang too."""
    out: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "max_new_tokens": params.max_new_tokens,
    }
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if n != 1:
        out["n"] = n
    if seed is not None:
        out["sampling_seed"] = seed
    return out


def generate_payload(
    input_ids: Sequence[int], sampling: Mapping[str, Any], rid: str | None = None, *, lora_path: str | None = None
) -> dict[str, Any]:
    """`lora_path`: the name of a loaded LoRA adapter (SGLang takes the name there, not a path)."""
    payload: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": dict(sampling), "return_logprob": True}
    if rid is not None:
        payload["rid"] = rid
    if lora_path is not None:
        payload["lora_path"] = lora_path
    return payload


def batch_payload(
    input_ids: Sequence[int],
    samplings: Sequence[Mapping[str, Any]],
    rids: Sequence[str],
    *,
    lora_path: str | None = None,
) -> dict[str, Any]:
    """One request for len(samplings) samples of one prompt, each with its own sampling params (its own
    seed): SGLang's native `n` copies one params dict, seed included, to every sample."""
    if len(samplings) != len(rids):
        raise ValueError(f"{len(samplings)} sampling params for {len(rids)} rids")
    payload: dict[str, Any] = {
        "input_ids": [list(input_ids) for _ in samplings],
        "sampling_params": [dict(s) for s in samplings],
        "return_logprob": True,
        "rid": list(rids),
    }
    if lora_path is not None:
        payload["lora_path"] = lora_path  # one name for every sample (SGLang broadcasts a string)
    return payload


def request_id(prefix: str, *parts: int) -> str:
    """`prefix-i-j.`: never a prefix of another id of the same prefix (see RID_END)."""
    if RID_END in prefix:
        raise ValueError(f"request id prefix {prefix!r} contains {RID_END!r}")
    return "-".join([prefix, *(str(p) for p in parts)]) + RID_END


def finish_reason_of(meta_info: Mapping[str, Any]) -> str:
    """`meta_info.finish_reason.type` -> stop | length | abort (the RolloutEngine finish reasons)."""
    reason = meta_info.get("finish_reason")
    if reason is None:
        raise SGLangRequestError(f"SGLang response without finish_reason (unfinished request?): {dict(meta_info)}")
    kind = reason.get("type") if isinstance(reason, Mapping) else str(reason)
    if kind not in FINISH_TYPES:
        raise SGLangRequestError(f"unknown SGLang finish_reason type {kind!r} (known: {sorted(FINISH_TYPES)})")
    return FINISH_TYPES[kind]


def output_from_response(body: Mapping[str, Any]) -> GenerationOutput:
    """One /generate result -> GenerationOutput (ids from `output_ids`, log-probs from meta_info)."""
    meta = body.get("meta_info") or {}
    finish = finish_reason_of(meta)
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        raise SGLangRequestError("SGLang response has no meta_info.output_token_logprobs: was return_logprob sent?")
    log_probs = [float(p[0]) for p in pairs]
    ids_from_logprobs = [int(p[1]) for p in pairs]
    ids = [int(t) for t in body["output_ids"]] if body.get("output_ids") is not None else ids_from_logprobs
    if ids != ids_from_logprobs:
        raise SGLangRequestError(
            f"SGLang output_ids ({len(ids)} tokens) disagree with the token ids of output_token_logprobs "
            f"({len(ids_from_logprobs)}) for request {meta.get('id')!r}"
        )
    return GenerationOutput(response_ids=ids, log_probs=log_probs, finish_reason=finish)


def aborted_output() -> GenerationOutput:
    return GenerationOutput(response_ids=[], log_probs=[], finish_reason="abort")


def torch_dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def serialize_named_tensors(named: list[tuple[str, Any]]) -> bytes:
    """`[(name, tensor), ...]` in SGLang's `MultiprocessingSerializer` format: CUDA tensors become CUDA
    IPC handles naming their GPU by UUID, CPU tensors carry their bytes (see tasks/sync/ipc.py)."""
    return ipc_serialize(named)
