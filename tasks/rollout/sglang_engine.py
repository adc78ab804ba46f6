"""The `sglang` rollout engine: SGLang servers spoken to over their native HTTP API.

Token ids in, token ids + log-probs out (`POST /generate` with `input_ids` and `return_logprob`),
one request per sample (or `sampling_params.n`), balanced over one or more servers. Weight updates
take one of three paths:

- disk: the trainer's tensors are written as an HF safetensors directory (`write_hf_checkpoint`),
  then `POST /update_weights_from_disk` (works anywhere the server can read the directory);
- tensor (colocated): `POST /update_weights_from_tensor` with one base64 payload per TP rank, each a
  flattened bucket (`load_format="flattened_bucket"`: one uint8 tensor + SGLang's per-tensor metadata,
  tasks/sync/ipc.py); CUDA tensors serialize as CUDA IPC handles, so only metadata crosses HTTP, and
  each TP rank's payload must come from a process on that rank's GPU (flows/weight_sync.py pairs them);
- distributed (disaggregated): `POST /init_weights_update_group` while the trainer joins as rank 0,
  then per bucket `POST /update_weights_from_distributed` with names/dtypes/shapes while the trainer
  broadcasts the tensors in the same order (NCCL on GPUs; gloo works for CPU tests).

Tensor and distributed updates run inside a weight-update session (`POST /begin_weight_update` ...
`POST /end_weight_update`, per server): SGLang 0.5.23 refuses them otherwise (HTTP 400).

Memory release/resume (`tags`: "weights", "kv_cache", "cuda_graph") serves colocation: the server must
be idle before a release (SGLang asserts it), so the engine flushes the cache until it answers 200
first, and resumes only tags it released (SGLang raises on resuming a tag it holds). Request ids end
with `RID_END`: SGLang aborts by rid prefix, so no id may be a prefix of another. The payload shapes
are those of SGLang 0.5.23 (`sglang/srt/managers/io_struct.py`, `sglang/srt/entrypoints/http_server.py`);
`tests/fixtures/sglang_protocol.json` records them with their sources.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import contextlib
import dataclasses
import itertools
import json
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from rollflow.tasks.rollout.engine import (
    GenerationOutput, GenerationRequest, SamplingParams, next_weight_version, sample_seed,
)
from rollflow.tasks.rollout.sglang_server import EngineDiedError, SGLangServer  # noqa: F401 - EngineDiedError re-exported
from rollflow.tasks.sync.buckets import buckets_by_bytes  # noqa: F401 - re-exported
from rollflow.tasks.sync.weight_group import DEFAULT_GROUP

FINISH_TYPES = {"stop": "stop", "length": "length", "abort": "abort"}
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # sglang/srt/constants.py GPU_MEMORY_ALL_TYPES
# SGLang aborts every request whose rid STARTS WITH the rid given (scheduler.abort_request): ending every
# id with a character used nowhere else in it makes no id a prefix of another.
RID_END = "."


class SGLangRequestError(RuntimeError):
    """An SGLang endpoint answered with an error (or not at all while its process still runs)."""


# ----------------------------------------------------------------------------------------------
# Payloads (pure functions: the contract tests check them against SGLang's schemas)
# ----------------------------------------------------------------------------------------------


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


def generate_payload(input_ids: Sequence[int], sampling: Mapping[str, Any], rid: str | None = None) -> dict[str, Any]:
    payload: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": dict(sampling),
                               "return_logprob": True}
    if rid is not None:
        payload["rid"] = rid
    return payload


def batch_payload(input_ids: Sequence[int], samplings: Sequence[Mapping[str, Any]],
                  rids: Sequence[str]) -> dict[str, Any]:
    """One request for len(samplings) samples of one prompt, each with its own sampling params (its own
    seed): SGLang's native `n` copies one params dict, seed included, to every sample."""
    if len(samplings) != len(rids):
        raise ValueError(f"{len(samplings)} sampling params for {len(rids)} rids")
    return {"input_ids": [list(input_ids) for _ in samplings], "sampling_params": [dict(s) for s in samplings],
            "return_logprob": True, "rid": list(rids)}


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
            f"({len(ids_from_logprobs)}) for request {meta.get('id')!r}")
    return GenerationOutput(response_ids=ids, log_probs=log_probs, finish_reason=finish)


def aborted_output() -> GenerationOutput:
    return GenerationOutput(response_ids=[], log_probs=[], finish_reason="abort")


def torch_dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def serialize_named_tensors(named: list[tuple[str, Any]]) -> bytes:
    """`[(name, tensor), ...]` in SGLang's `MultiprocessingSerializer` format: CUDA tensors become CUDA
    IPC handles naming their GPU by UUID, CPU tensors carry their bytes (see tasks/sync/ipc.py)."""
    from rollflow.tasks.sync.ipc import serialize_named_tensors as ipc_serialize

    return ipc_serialize(named)


# ----------------------------------------------------------------------------------------------
# Load balancing
# ----------------------------------------------------------------------------------------------


class EndpointPool:
    """Pick a server per request: round robin, or the one with the fewest requests in flight."""

    def __init__(self, urls: Sequence[str], policy: str = "least_outstanding"):
        if not urls:
            raise ValueError("an SGLang engine needs at least one server URL")
        if policy not in ("round_robin", "least_outstanding"):
            raise ValueError(f"unknown load_balance policy {policy!r}: round_robin or least_outstanding")
        self.urls = list(urls)
        self.policy = policy
        self.outstanding = {u: 0 for u in self.urls}
        self.sent = {u: 0 for u in self.urls}
        self._rr = itertools.cycle(range(len(self.urls)))
        self._lock = threading.Lock()

    def acquire(self) -> str:
        with self._lock:
            if self.policy == "round_robin":
                url = self.urls[next(self._rr)]
            else:  # ties go to the earliest URL in list order
                url = min(self.urls, key=lambda u: self.outstanding[u])
            self.outstanding[url] += 1
            self.sent[url] += 1
            return url

    def release(self, url: str) -> None:
        with self._lock:
            self.outstanding[url] -= 1


# ----------------------------------------------------------------------------------------------
# HF checkpoint writing (the disk path)
# ----------------------------------------------------------------------------------------------

CONFIG_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja", ".py")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def write_hf_checkpoint(named_tensors: Mapping[str, Any], out_dir: str | Path, *, config_dir: str | Path | None = None,
                        config: Mapping[str, Any] | None = None, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write HF-named tensors as `model.safetensors` (or shards + `model.safetensors.index.json`) plus
    the model's config files, into `out_dir` atomically (a temp sibling renamed at the end)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        if config_dir is not None:
            for item in Path(config_dir).iterdir():
                if item.is_file() and item.suffix in CONFIG_SUFFIXES and item.name not in WEIGHT_FILES:
                    shutil.copy2(item, tmp / item.name)
        if config is not None:
            (tmp / "config.json").write_text(json.dumps(dict(config), indent=2))
        if not (tmp / "config.json").exists():
            raise ValueError("write_hf_checkpoint needs config_dir (with config.json) or config")
        tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in named_tensors.items()}
        shards: list[dict[str, Any]] = [{}]
        size = 0
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t
            size += nbytes
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map, total = {}, 0
            for i, shard in enumerate(shards, start=1):
                fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                for name, t in shard.items():
                    weight_map[name] = fname
                    total += t.numel() * t.element_size()
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# ----------------------------------------------------------------------------------------------
# The engine
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Inflight:
    rid: str
    url: str


class SGLangEngine:
    """A RolloutEngine over one or more SGLang servers (URLs; optionally the processes behind them)."""

    def __init__(self, urls: Sequence[str] | str, *, servers: Sequence[SGLangServer] = (), model_name: str = "model",
                 weight_version: int = 0, tp_sizes: Sequence[int] | int = 1, request_timeout: float = 3600.0,
                 max_inflight: int = 256, load_balance: str = "least_outstanding", n_mode: str = "repeat",
                 seeded: bool = False, weight_sync: str = "disk", weight_dir: str | Path | None = None,
                 config_dir: str | Path | None = None, bucket_bytes: int = 512 * 2**20,
                 tensor_device: str | None = None):
        import httpx

        self.urls = [urls] if isinstance(urls, str) else list(urls)
        self.pool = EndpointPool(self.urls, load_balance)
        self.servers = {s.url: s for s in servers}
        self.model_name = model_name
        self.weight_version = weight_version
        self.tp_sizes = [tp_sizes] * len(self.urls) if isinstance(tp_sizes, int) else list(tp_sizes)
        if len(self.tp_sizes) != len(self.urls):
            raise ValueError(f"tp_sizes has {len(self.tp_sizes)} entries for {len(self.urls)} servers")
        if n_mode not in ("repeat", "native"):
            raise ValueError(f"n_mode={n_mode!r}: repeat or native")
        if weight_sync not in ("disk", "tensor", "distributed"):
            raise ValueError(f"weight_sync={weight_sync!r}: disk, tensor or distributed")
        self.request_timeout = request_timeout
        self.max_inflight = max_inflight
        self.n_mode = n_mode
        self.seeded = seeded
        self.weight_sync = weight_sync
        self.weight_dir = Path(weight_dir) if weight_dir else None
        self.config_dir = Path(config_dir) if config_dir else None
        self.bucket_bytes = bucket_bytes
        self.tensor_device = tensor_device
        self.client = httpx.Client(timeout=httpx.Timeout(request_timeout, connect=10.0),
                                   limits=httpx.Limits(max_connections=max_inflight + 16,
                                                       max_keepalive_connections=max_inflight + 16))
        self.weight_group: str | None = None  # the trainer's weight-update group these servers joined
        self.released: dict[str, set[str]] = {u: set() for u in self.urls}  # memory tags released, per server
        self.idle_timeout_s = 300.0  # how long a release waits for the server to become idle
        self._abort = threading.Event()
        self._inflight: dict[str, _Inflight] = {}
        self._lock = threading.Lock()
        self._call = 0

    def _target_version(self, weight_version: int) -> int:
        """The next version; or the current one again (a re-sync of the same weights, e.g. the startup
        weight-update check), which cannot lose or double an update."""
        if weight_version == self.weight_version:
            return weight_version
        return next_weight_version(self.weight_version, weight_version)

    # -- RolloutEngine ---------------------------------------------------------------------------
    def describe(self) -> dict[str, str]:
        return {"backend": "sglang", "model": self.model_name, "weight_version": str(self.weight_version)}

    def alive(self) -> bool:
        """False once a launched server process has exited (URL-only engines: a quick /health)."""
        if self.servers:
            return all(s.alive() for s in self.servers.values())
        try:
            return all(self.client.get(f"{u}/health", timeout=5.0).status_code == 200 for u in self.urls)
        except Exception:  # noqa: BLE001 - unreachable is not alive
            return False

    def check_alive(self, during: str = "rollout") -> None:
        for server in self.servers.values():
            server.check_alive(during)

    def generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[list[GenerationOutput]]:
        """One list of `n` outputs per request, in request order; aborted samples come back with
        finish_reason 'abort' (status aborted), a dead server raises EngineDiedError with its log tail."""
        self._abort.clear()
        with self._lock:
            self._call += 1
            prefix = f"rf{os.getpid()}-{self._call}-{uuid.uuid4().hex[:6]}"
        # (request idx, ids, n, rid, seeds): one seed per sample, or [None] (unseeded, native n)
        jobs: list[tuple[int, list[int], int, str, list[int | None]]] = []
        sample = 0
        for i, req in enumerate(requests):
            if self.n_mode == "native":
                seeds = [self._seed(params, sample + j) for j in range(req.n)]
                jobs.append((i, req.prompt_ids, req.n, request_id(prefix, i),
                             seeds if seeds[0] is not None else [None]))
                sample += req.n
            else:
                for j in range(req.n):
                    jobs.append((i, req.prompt_ids, 1, request_id(prefix, i, j), [self._seed(params, sample)]))
                    sample += 1
        results: list[list[GenerationOutput]] = [[] for _ in requests]
        if not jobs:
            return results
        workers = min(self.max_inflight, len(jobs))
        pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sglang-generate")
        try:
            futures = [pool.submit(self._run_job, ids, params, n, rid, seed) for _, ids, n, rid, seed in jobs]
            done: list[list[GenerationOutput]] = []
            for fut in futures:  # request order; the first failure stops the rest
                try:
                    done.append(fut.result())
                except BaseException:
                    self._abort.set()  # queued samples are not sent; in-flight ones are aborted server-side
                    for other in futures:
                        other.cancel()
                    self._abort_all_quietly()
                    raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        for (i, *_), outs in zip(jobs, done):
            results[i].extend(outs)
        return results

    def _seed(self, params: SamplingParams, sample: int) -> int | None:
        if not self.seeded or params.seed is None:
            return None
        return sample_seed(params.seed, sample)

    def _run_job(self, ids: list[int], params: SamplingParams, n: int, rid: str,
                 seeds: list[int | None]) -> list[GenerationOutput]:
        if self._abort.is_set():
            return [aborted_output() for _ in range(n)]
        if len(seeds) == n and n > 1:  # seeded native n: n samples with n seeds, as one batch request
            # children `rid` + `j.`: aborting `rid` aborts them all (as SGLang's own `rid_k` children of n)
            payload = batch_payload(ids, [sampling_params_payload(params, seed=seed) for seed in seeds],
                                    [f"{rid}{j}{RID_END}" for j in range(n)])
        else:
            payload = generate_payload(ids, sampling_params_payload(params, n=n, seed=seeds[0]), rid)
        url = self.pool.acquire()
        with self._lock:
            self._inflight[rid] = _Inflight(rid, url)
        try:
            body = self._post_generate(url, payload)
        finally:
            with self._lock:
                self._inflight.pop(rid, None)
            self.pool.release(url)
        items = body if isinstance(body, list) else [body]
        if len(items) != n:
            raise SGLangRequestError(f"{url}/generate returned {len(items)} results for n={n} (rid {rid})")
        return [output_from_response(item) for item in items]

    def _post_generate(self, url: str, payload: dict[str, Any]) -> Any:
        import httpx

        try:
            r = self.client.post(f"{url}/generate", json=payload)
        except httpx.TransportError as exc:
            self._raise_if_died(url, during=f"/generate (rid {payload.get('rid')})")
            raise SGLangRequestError(f"{url}/generate failed: {type(exc).__name__}: {exc}") from exc
        if r.status_code != 200:
            self._raise_if_died(url, during="/generate")
            raise SGLangRequestError(f"{url}/generate answered {r.status_code}: {r.text[:500]}")
        return r.json()

    def _raise_if_died(self, url: str, during: str, grace_s: float = 3.0) -> None:
        """A dropped connection to a launched server: give the process a moment to exit, then report it."""
        server = self.servers.get(url)
        if server is None:
            return
        deadline = time.monotonic() + grace_s
        while server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        server.check_alive(during)

    # -- abort -----------------------------------------------------------------------------------
    def abort(self, rids: Sequence[str] | None = None) -> int:
        """Abort in-flight requests (all of them, or these rids); not-yet-sent samples of the running
        `generate` come back aborted without being sent. Returns the number of abort calls made."""
        calls = 0
        if rids is None:
            self._abort.set()
            for url in self.urls:
                self._post(url, "/abort_request", {"abort_all": True})
                calls += 1
            return calls
        with self._lock:
            targets = [(rid, self._inflight[rid].url) for rid in rids if rid in self._inflight]
        for rid, url in targets:
            self._post(url, "/abort_request", {"rid": rid, "abort_all": False})
            calls += 1
        return calls

    def _abort_all_quietly(self) -> None:
        for url in self.urls:
            server = self.servers.get(url)
            if server is not None and not server.alive():
                continue
            try:
                self.client.post(f"{url}/abort_request", json={"abort_all": True}, timeout=5.0)
            except Exception:  # noqa: BLE001 - best effort while an error is already on its way up
                pass

    def inflight(self) -> list[str]:
        with self._lock:
            return sorted(self._inflight)

    # -- plain endpoints -------------------------------------------------------------------------
    def _post(self, url: str, path: str, payload: Mapping[str, Any] | None = None, *, timeout: float | None = None):
        import httpx

        try:
            r = self.client.post(f"{url}{path}", json=payload if payload is not None else {},
                                 timeout=timeout or self.request_timeout)
        except httpx.TransportError as exc:
            self._raise_if_died(url, during=path)
            raise SGLangRequestError(f"{url}{path} failed: {type(exc).__name__}: {exc}") from exc
        if r.status_code != 200:
            raise SGLangRequestError(f"{url}{path} answered {r.status_code}: {r.text[:500]}")
        if not r.content:
            return None
        try:
            body = r.json()
        except ValueError:
            return r.text
        if isinstance(body, Mapping) and body.get("success") is False:
            raise SGLangRequestError(f"{url}{path} failed: {body.get('message')}")
        return body

    def _get(self, url: str, path: str):
        r = self.client.get(f"{url}{path}", timeout=30.0)
        if r.status_code != 200:
            raise SGLangRequestError(f"{url}{path} answered {r.status_code}: {r.text[:500]}")
        return r.json()

    def health(self) -> dict[str, bool]:
        out = {}
        for url in self.urls:
            try:
                out[url] = self.client.get(f"{url}/health", timeout=10.0).status_code == 200
            except Exception:  # noqa: BLE001
                out[url] = False
        return out

    def health_generate(self) -> dict[str, bool]:
        """GET /health_generate: the server generates one token (a deeper check than /health)."""
        out = {}
        for url in self.urls:
            try:
                out[url] = self.client.get(f"{url}/health_generate", timeout=60.0).status_code == 200
            except Exception:  # noqa: BLE001
                out[url] = False
        return out

    def model_info(self, url: str | None = None) -> dict[str, Any]:
        """GET /model_info (SGLang >= 0.5.x; falls back to the deprecated /get_model_info)."""
        return self._get_info(url or self.urls[0], "/model_info", "/get_model_info")

    def server_info(self, url: str | None = None) -> dict[str, Any]:
        """GET /server_info (falls back to the deprecated /get_server_info)."""
        return self._get_info(url or self.urls[0], "/server_info", "/get_server_info")

    def _get_info(self, url: str, path: str, legacy_path: str) -> dict[str, Any]:
        r = self.client.get(f"{url}{path}", timeout=30.0)
        if r.status_code == 404:
            return self._get(url, legacy_path)
        if r.status_code != 200:
            raise SGLangRequestError(f"{url}{path} answered {r.status_code}: {r.text[:500]}")
        return r.json()

    def flush_cache(self) -> None:
        for url in self.urls:
            self._post(url, "/flush_cache")

    def wait_idle(self, url: str, timeout_s: float | None = None, interval_s: float = 0.05) -> int:
        """POST /flush_cache until it answers 200: SGLang flushes only an idle server and answers 400
        while requests run or wait (e.g. just after an abort). Returns the attempts it took."""
        import httpx

        deadline = time.monotonic() + (self.idle_timeout_s if timeout_s is None else timeout_s)
        attempts = 0
        while True:
            attempts += 1
            try:
                r = self.client.post(f"{url}/flush_cache", timeout=30.0)
                last = f"{r.status_code}: {r.text[:200]}"
                if r.status_code == 200:
                    return attempts
            except httpx.TransportError as exc:
                self._raise_if_died(url, during="/flush_cache")
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                raise SGLangRequestError(f"{url} still busy after {attempts} /flush_cache attempts (last answer "
                                         f"{last}): SGLang releases memory only on an idle server")
            time.sleep(interval_s)

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """POST /release_memory_occupation: free `tags` (weights, kv_cache, cuda_graph; None = all) for a
        colocated trainer, on an idle server (flushed until it answers 200 first: SGLang asserts idleness
        inside its scheduler). Tags already released are not released again. Needs the server launched
        with --enable-memory-saver."""
        wanted = self._tags(tags) or list(MEMORY_TAGS)
        for url in self.urls:
            todo = [t for t in wanted if t not in self.released[url]]
            if not todo:
                continue
            self.wait_idle(url)
            self._post(url, "/release_memory_occupation", {"tags": todo})
            self.released[url].update(todo)

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """POST /resume_memory_occupation for the tags (None = all) this engine released and has not
        resumed: SGLang raises on resuming a tag it holds, so a retried resume is a no-op. The CUDA
        graphs come back with the KV cache (they were captured over it)."""
        wanted = self._tags(tags) or list(MEMORY_TAGS)
        if "kv_cache" in wanted and "cuda_graph" not in wanted:
            wanted.append("cuda_graph")
        for url in self.urls:
            todo = [t for t in wanted if t in self.released[url]]
            if not todo:
                continue
            self._post(url, "/resume_memory_occupation", {"tags": todo})
            self.released[url].difference_update(todo)

    @staticmethod
    def _tags(tags: Sequence[str] | None) -> list[str] | None:
        if tags is None:
            return None
        bad = sorted(set(tags) - set(MEMORY_TAGS))
        if bad:
            raise ValueError(f"unknown memory tags {bad}; SGLang knows {list(MEMORY_TAGS)}")
        return list(tags)

    def offload(self) -> None:
        """Colocation, before training: release the KV cache, the weights and the CUDA graphs."""
        self.release_memory(["kv_cache", "weights", "cuda_graph"])

    def onload_weights(self) -> None:
        """Colocation, after training and before the weight update: weights back, KV cache still free."""
        self.resume_memory(["weights"])

    def onload_kv_cache(self) -> None:
        """Colocation, after the weight update: KV cache and CUDA graphs back, ready to generate."""
        self.resume_memory(["kv_cache", "cuda_graph"])

    # -- weight-update session (SGLang 0.5.23: tensor and distributed updates only inside one) --------
    def begin_weight_update(self) -> None:
        """POST /begin_weight_update on every server. A session left open by a failed attempt (a Prefect
        retry of the sync) is closed and opened again."""
        opened: list[str] = []
        try:
            for url in self.urls:
                try:
                    self._post(url, "/begin_weight_update", {})
                except SGLangRequestError as exc:
                    if "already open" not in str(exc):
                        raise
                    self._post(url, "/end_weight_update", {})
                    self._post(url, "/begin_weight_update", {})
                opened.append(url)
        except BaseException:
            for url in opened:
                self._end_quietly(url)
            raise

    def end_weight_update(self) -> None:
        """POST /end_weight_update on every server (each is tried even when one fails)."""
        errors = []
        for url in self.urls:
            try:
                self._post(url, "/end_weight_update", {})
            except SGLangRequestError as exc:
                errors.append(str(exc))
        if errors:
            raise SGLangRequestError("; ".join(errors))

    def _end_quietly(self, url: str) -> None:
        try:
            self._post(url, "/end_weight_update", {}, timeout=30.0)
        except Exception:  # noqa: BLE001 - best effort while another error is on its way up
            pass

    @contextlib.contextmanager
    def weight_update_session(self):
        self.begin_weight_update()
        try:
            yield
        except BaseException:
            for url in self.urls:
                self._end_quietly(url)
            raise
        self.end_weight_update()

    # -- weights ---------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Mapping[str, Any], weight_version: int) -> None:
        """The RolloutEngine entry point: tensors from the trainer, through the configured path."""
        if self.weight_sync == "tensor":
            self.update_weights_from_tensor(named_tensors, weight_version)
        elif self.weight_sync == "disk":
            if self.weight_dir is None:
                import tempfile

                self.weight_dir = Path(tempfile.mkdtemp(prefix="rollflow-sglang-weights-"))
            if self.config_dir is None:
                raise ValueError("disk weight updates need the model's config_dir (config.json to write beside "
                                 "the tensors)")
            target = self.weight_dir / f"v{weight_version:06d}"
            write_hf_checkpoint(named_tensors, target, config_dir=self.config_dir)
            self.update_weights_from_disk(target, weight_version)
            for old in self.weight_dir.glob("v*"):  # keep the newest two versions on disk
                if old.name < f"v{weight_version - 1:06d}":
                    shutil.rmtree(old, ignore_errors=True)
        else:
            raise RuntimeError(
                "weight_sync='distributed' is driven by the trainer, which owns the tensors and the NCCL group: "
                "call SGLangEngine.sync_weights_distributed(...) from the trainer side (see tasks/rollout/"
                "sglang_engine.py), or use weight_sync='disk' through this call")

    def update_weights_from_disk(self, model_path: str | Path, weight_version: int, *, load_format: str | None = None,
                                 flush_cache: bool = True, abort_all_requests: bool = False) -> None:
        version = self._target_version(weight_version)
        payload: dict[str, Any] = {"model_path": str(model_path), "weight_version": str(version),
                                   "flush_cache": flush_cache, "abort_all_requests": abort_all_requests}
        if load_format is not None:
            payload["load_format"] = load_format
        for url in self.urls:
            self._post(url, "/update_weights_from_disk", payload)
        self.weight_version = version

    def update_weights_from_tensor(self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
                                   weight_version: int, *, serializer: Callable[[list], bytes] | None = None,
                                   load_format: str | None = None, device: str | None = None) -> int:
        """Bucketed POST /update_weights_from_tensor inside a weight-update session; one serialized payload
        per TP rank of each server (default: SGLang's flattened bucket; `serializer` + `load_format` for
        another). Tensors move to `device` first (colocated: the engine's GPU, so they travel as IPC
        handles). Returns the number of requests per server."""
        self._target_version(weight_version)  # a skipped or repeated version fails before anything is sent
        items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
        device = device or self.tensor_device
        if device is not None:
            items = [(name, t.to(device)) for name, t in items]
        buckets = list(buckets_by_bytes(items, self.bucket_bytes))
        with self.weight_update_session():
            for b, bucket in enumerate(buckets):
                if serializer is None:  # SGLang's flattened bucket: one uint8 tensor + metadata per payload
                    from rollflow.tasks.sync.ipc import FLATTENED_BUCKET, flatten_bucket, serialize_flattened_bucket

                    flat, entries = flatten_bucket(bucket)
                    raw, fmt = serialize_flattened_bucket(flat, entries), FLATTENED_BUCKET
                else:
                    raw, fmt = serializer(bucket), load_format
                payloads = [base64.b64encode(raw).decode("ascii") for _ in range(self.payloads_per_bucket)]
                self.apply_serialized_bucket(payloads, last=b == len(buckets) - 1, weight_version=weight_version,
                                             load_format=fmt)
        return len(buckets)

    @property
    def weight_group_world_size(self) -> int:
        """Ranks of the weight-update group: the trainer (rank 0) plus every TP rank of every server."""
        return 1 + sum(self.tp_sizes)

    def init_weights_update_group(self, master_address: str, master_port: int, *, group_name: str = DEFAULT_GROUP,
                                  backend: str = "nccl") -> list[cf.Future]:
        """Ask every server to join the group (async: each call blocks until the trainer joins as rank 0).
        Server k's ranks start after rank 0 and the ranks of servers before it."""
        world_size = self.weight_group_world_size
        offsets = [1 + sum(self.tp_sizes[:k]) for k in range(len(self.urls))]
        pool = cf.ThreadPoolExecutor(max_workers=len(self.urls), thread_name_prefix="sglang-group")
        futures = [pool.submit(self._post, url, "/init_weights_update_group",
                               {"master_address": master_address, "master_port": master_port, "rank_offset": off,
                                "world_size": world_size, "group_name": group_name, "backend": backend})
                   for url, off in zip(self.urls, offsets)]
        pool.shutdown(wait=False)
        return futures

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                                        *, group_name: str = DEFAULT_GROUP, weight_version: int | None = None,
                                        flush_cache: bool = True) -> list[cf.Future]:
        """The metadata of one bucket (async: each call returns once the broadcast has arrived)."""
        payload: dict[str, Any] = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
                                   "group_name": group_name, "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        pool = cf.ThreadPoolExecutor(max_workers=len(self.urls), thread_name_prefix="sglang-dist")
        futures = [pool.submit(self._post, url, "/update_weights_from_distributed", payload) for url in self.urls]
        pool.shutdown(wait=False)
        return futures

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> None:
        for url in self.urls:
            self._post(url, "/destroy_weights_update_group", {"group_name": group_name})
        if self.weight_group == group_name:
            self.weight_group = None

    def sync_weights_distributed(self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], weight_version: int,
                                 *, broadcast: Callable[[Any], None], join_group: Callable[[], Any] | None = None,
                                 master_address: str = "127.0.0.1", master_port: int | None = None,
                                 group_name: str = DEFAULT_GROUP, backend: str = "nccl", timeout_s: float = 600.0) -> int:
        """The trainer's side of the NCCL path, in SGLang's call order:

        1. (once, when `join_group` is given) POST /init_weights_update_group to every server while
           `join_group()` makes the trainer rank 0 of the same group (e.g. `init_weight_group(...)`, tasks/sync/weight_group.py);
        2. inside a weight-update session, per bucket: POST /update_weights_from_distributed (names,
           dtypes, shapes) to every server while `broadcast(tensor)` sends each tensor of the bucket in
           the same order.
        Returns the number of buckets.
        """
        version = self._target_version(weight_version)
        if join_group is not None:
            if master_port is None:
                raise ValueError("init of the weight group needs master_port")
            futures = self.init_weights_update_group(master_address, master_port, group_name=group_name, backend=backend)
            join_group()
            for fut in futures:
                fut.result(timeout=timeout_s)
        items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
        buckets = list(buckets_by_bytes(items, self.bucket_bytes))
        with self.weight_update_session():
            for b, bucket in enumerate(buckets):
                last = b == len(buckets) - 1
                futures = self.update_weights_from_distributed(
                    [n for n, _ in bucket], [torch_dtype_name(t.dtype) for _, t in bucket],
                    [list(t.shape) for _, t in bucket],
                    group_name=group_name, weight_version=version if last else None, flush_cache=last)
                for _, tensor in bucket:
                    broadcast(tensor)
                for fut in futures:
                    fut.result(timeout=timeout_s)
        self.weight_version = version
        return len(buckets)

    # -- trainer-driven paths: the payloads / broadcasts come from the trainer actor -------------------
    @property
    def payloads_per_bucket(self) -> int:
        """Serialized copies one tensor bucket needs: one per TP rank of every server (CUDA IPC
        refcounts are per serialization, so no two ranks may share one)."""
        return sum(self.tp_sizes)

    def apply_serialized_bucket(self, payloads: Sequence[str], *, last: bool, weight_version: int,
                                load_format: str | None = None) -> None:
        """One bucket of `/update_weights_from_tensor`, serialized `payloads_per_bucket` times (by the
        trainer: CUDA IPC handles of its own GPU tensors, tasks/sync/ipc.py); server k's ranks get the
        next tp_k payloads. The last bucket flushes the cache and sets the version."""
        if len(payloads) != self.payloads_per_bucket:
            raise ValueError(f"{len(payloads)} serialized payloads for servers with tp sizes {self.tp_sizes}: "
                             f"one per TP rank of every server ({self.payloads_per_bucket}) is needed")
        version = self._target_version(weight_version) if last else None
        offset = 0
        for url, tp in zip(self.urls, self.tp_sizes):
            payload: dict[str, Any] = {"serialized_named_tensors": list(payloads[offset:offset + tp]),
                                       "flush_cache": last}
            offset += tp
            if load_format is not None:
                payload["load_format"] = load_format
            if version is not None:
                payload["weight_version"] = str(version)
            self._post(url, "/update_weights_from_tensor", payload)
        if version is not None:
            self.weight_version = version

    def join_weight_group(self, master_address: str, master_port: int, *, group_name: str = DEFAULT_GROUP,
                          backend: str = "nccl", timeout_s: float = 600.0) -> None:
        """Every server joins the trainer's group (returns once the trainer, rank 0, has joined too)."""
        for fut in self.init_weights_update_group(master_address, master_port, group_name=group_name, backend=backend):
            fut.result(timeout=timeout_s)
        self.weight_group = group_name

    def receive_bucket(self, metas: Sequence[Mapping[str, Any]], *, last: bool, weight_version: int,
                       group_name: str = DEFAULT_GROUP, timeout_s: float = 600.0) -> None:
        """Receive one bucket the trainer broadcasts (`metas`: name, dtype, shape in sending order)."""
        version = self._target_version(weight_version) if last else None
        futures = self.update_weights_from_distributed(
            [m["name"] for m in metas], [m["dtype"] for m in metas], [list(m["shape"]) for m in metas],
            group_name=group_name, weight_version=version, flush_cache=last)
        for fut in futures:
            fut.result(timeout=timeout_s)
        if version is not None:
            self.weight_version = version

    def get_weights_by_name(self, name: str, truncate_size: int = 100, url: str | None = None):
        return self._post(url or self.urls[0], "/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    def named_weights(self):
        raise NotImplementedError(
            "an SGLang engine does not export its weights; compare a few tensors with get_weights_by_name() "
            "(SGLang's /get_weights_by_name) or checksum the directory written for a disk update")

    def shutdown(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.client.close()


# ----------------------------------------------------------------------------------------------
# From RolloutConfig (what tasks/rollout/worker.py:build_engine calls for rollout.engine='sglang')
# ----------------------------------------------------------------------------------------------


def engine_options(model_dir: str | Path, rollout, *, model_name: str, weight_version: int = 0) -> dict[str, Any]:
    """SGLangEngine keyword arguments from a RolloutConfig (everything but the servers)."""
    cfg = rollout.sglang
    weight_sync = "disk" if cfg.weight_sync == "auto" else cfg.weight_sync
    tensor_device = None
    if weight_sync == "tensor":
        import torch

        tensor_device = "cuda" if torch.cuda.is_available() else None
    return dict(model_name=model_name, weight_version=weight_version, tp_sizes=cfg.tp_size or 1,
                request_timeout=cfg.request_timeout_s, max_inflight=cfg.max_inflight, load_balance=cfg.load_balance,
                n_mode=cfg.n_mode, seeded=cfg.seeded, weight_sync=weight_sync, weight_dir=cfg.weight_dir,
                config_dir=model_dir, tensor_device=tensor_device, bucket_bytes=cfg.bucket_mb * 2**20)


def engine_from_config(model_dir: str | Path, rollout, *, model_name: str, weight_version: int = 0,
                       base_gpu_id: int | None = None, log_dir: str | Path | None = None,
                       servers: Sequence[Any] | None = None) -> SGLangEngine:
    """An SGLangEngine over `servers` (already launched, e.g. one Ray actor per engine: objects with the
    SGLangServer interface), over `rollout.sglang.urls`, or over one server launched here on loopback.

    `rollout` is a RolloutConfig (its `sglang` section holds the launch settings). SGLang itself is
    needed only to launch the default `python -m sglang.launch_server`; a missing install is reported
    here, at use time, with the install hint.
    """
    from rollflow.tasks.rollout.server_worker import dropped_env, launch_spec_for, server_env

    common = engine_options(model_dir, rollout, model_name=model_name, weight_version=weight_version)
    if servers:
        return SGLangEngine([s.url for s in servers], servers=servers, **common)
    if rollout.sglang.urls:
        return SGLangEngine(rollout.sglang.urls, **common)
    spec = launch_spec_for(model_dir, rollout, base_gpu_id=base_gpu_id, weight_version=weight_version)
    log_path = Path(log_dir) / f"sglang-{spec.port}.log" if log_dir else None
    server = SGLangServer(spec, log_path=log_path, env=server_env(rollout, None),
                          tail_lines=rollout.sglang.log_tail_lines, drop_env=dropped_env(rollout)).start()
    try:
        server.wait_healthy(rollout.sglang.startup_timeout_s)
    except BaseException:
        server.stop(timeout=10)
        raise
    return SGLangEngine([server.url], servers=[server], **common)
