"""The `sglang` rollout engine: SGLang servers spoken to over their native HTTP API.

Token ids in, token ids + log-probs out (`POST /generate` with `input_ids` and `return_logprob`),
one request per sample (or `sampling_params.n`), balanced over one or more servers. Weight updates
(disk, tensor, distributed) are the engine's `WeightReceiver` half (weight_receiver.py); a LoRA run's
adapter updates (rollout.sglang.lora_sync=adapter) its `LoraReceiver` half (lora_receiver.py), after which
every generate request names the current adapter (`lora_path`).

Memory release/resume (`tags`: "weights", "kv_cache", "cuda_graph") serves colocation: the server must
be idle before a release (SGLang asserts it), so the engine flushes the cache until it answers 200
first, and resumes only tags it released (SGLang's scheduler raises on resuming a tag it holds, which ends the
server). Which tags are released is kept by the server object (`SGLangServer`, or the server's own actor
through `RemoteServer`), which lives exactly as long as the server process: a restarted engine actor reads it
back instead of forgetting it (SGLang 0.5.23 itself reports it nowhere). Request ids end
with `RID_END`: SGLang aborts by rid prefix, so no id may be a prefix of another. The payloads are
payloads.py's (SGLang 0.5.23's shapes).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import itertools
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence

from rollflow.tasks.progress import Progress
from rollflow.tasks.rollout.engine import GenerationOutput, GenerationRequest, SamplingParams, sample_seed
from rollflow.tasks.rollout.sglang.lora_receiver import LoraReceiver
from rollflow.tasks.rollout.sglang.payloads import (
    RID_END,
    SGLangRequestError,
    aborted_output,
    batch_payload,
    generate_payload,
    output_from_response,
    request_id,
    sampling_params_payload,
)
from rollflow.tasks.rollout.sglang.server import SGLangServer
from rollflow.tasks.rollout.sglang.weight_receiver import WeightReceiver

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # sglang/srt/constants.py GPU_MEMORY_ALL_TYPES


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
# The engine
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Inflight:
    rid: str
    url: str


class SGLangEngine(WeightReceiver, LoraReceiver):
    """A RolloutEngine over one or more SGLang servers (URLs; optionally the processes behind them)."""

    def __init__(
        self,
        urls: Sequence[str] | str,
        *,
        servers: Sequence[SGLangServer] = (),
        model_name: str = "model",
        weight_version: int = 0,
        tp_sizes: Sequence[int] | int = 1,
        request_timeout: float = 3600.0,
        max_inflight: int = 256,
        load_balance: str = "least_outstanding",
        n_mode: str = "repeat",
        seeded: bool = False,
        weight_sync: str = "disk",
        weight_dir: str | Path | None = None,
        config_dir: str | Path | None = None,
        bucket_bytes: int = 512 * 2**20,
        tensor_device: str | None = None,
        lora_sync: str = "merged",
    ):
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
        if lora_sync not in ("merged", "adapter"):
            raise ValueError(f"lora_sync={lora_sync!r}: merged or adapter")
        self.lora_sync = lora_sync
        # the adapter every generate request names (lora_sync=adapter; None: the base model, i.e. B = 0)
        self.lora_name: str | None = None
        self.lora_loads = 0  # adapters loaded so far (names of re-syncs of one version stay unique)
        self.lora_checksums: dict[str, str] = {}  # the current adapter's tensors as serialized for the servers
        self.lora_listed: dict[str, dict[str, str]] = {}  # per server: the adapters its last LoRA answer listed
        self.client = httpx.Client(
            timeout=httpx.Timeout(request_timeout, connect=10.0),
            limits=httpx.Limits(max_connections=max_inflight + 16, max_keepalive_connections=max_inflight + 16),
        )
        self.weight_group: str | None = None  # the trainer's weight-update group these servers joined
        self._open_sessions: set[str] = set()  # weight-update sessions this engine opened and has not ended
        # memory tags released, per server: read back from the server objects (a restarted actor over live servers)
        self.released: dict[str, set[str]] = {u: self._recorded_released(u) for u in self.urls}
        self.idle_timeout_s = 300.0  # how long a release waits for the server to become idle
        self._abort = threading.Event()
        self.progress = Progress()  # requests finished: a stall deadline's sign of life during a rollout
        self._inflight: dict[str, _Inflight] = {}
        self._lock = threading.Lock()
        self._call = 0

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
                jobs.append(
                    (i, req.prompt_ids, req.n, request_id(prefix, i), seeds if seeds[0] is not None else [None])
                )
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
            for fut in futures:
                fut.add_done_callback(lambda _: self.progress.tick())
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

    def _run_job(
        self, ids: list[int], params: SamplingParams, n: int, rid: str, seeds: list[int | None]
    ) -> list[GenerationOutput]:
        if self._abort.is_set():
            return [aborted_output() for _ in range(n)]
        if len(seeds) == n and n > 1:  # seeded native n: n samples with n seeds, as one batch request
            # children `rid` + `j.`: aborting `rid` aborts them all (as SGLang's own `rid_k` children of n)
            payload = batch_payload(
                ids,
                [sampling_params_payload(params, seed=seed) for seed in seeds],
                [f"{rid}{j}{RID_END}" for j in range(n)],
                lora_path=self.lora_name,
            )
        else:
            payload = generate_payload(
                ids, sampling_params_payload(params, n=n, seed=seeds[0]), rid, lora_path=self.lora_name
            )
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
            r = self.client.post(
                f"{url}{path}", json=payload if payload is not None else {}, timeout=timeout or self.request_timeout
            )
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
            # LoRA routes answer with `error_message`, the others with `message`
            raise SGLangRequestError(f"{url}{path} failed: {body.get('message') or body.get('error_message')}")
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
                raise SGLangRequestError(
                    f"{url} still busy after {attempts} /flush_cache attempts (last answer "
                    f"{last}): SGLang releases memory only on an idle server"
                )
            time.sleep(interval_s)

    def _recorded_released(self, url: str) -> set[str]:
        server = self.servers.get(url)
        return set(server.memory_released()) if server is not None else set()

    def _note_memory(self, url: str, released: Sequence[str] = (), resumed: Sequence[str] = ()) -> None:
        server = self.servers.get(url)
        if server is not None:
            server.note_memory(released=list(released), resumed=list(resumed))

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
            self._note_memory(url, released=todo)

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
            self._note_memory(url, resumed=todo)

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

    def get_weights_by_name(self, name: str, truncate_size: int = 100, url: str | None = None):
        return self._post(url or self.urls[0], "/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    def named_weights(self):
        raise NotImplementedError(
            "an SGLang engine does not export its weights; compare a few tensors with get_weights_by_name() "
            "(SGLang's /get_weights_by_name) or checksum the directory written for a disk update"
        )

    def shutdown(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.client.close()
