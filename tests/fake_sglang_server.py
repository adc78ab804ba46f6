"""A FAKE SGLang server for tests. It is NOT SGLang and runs no model.

It speaks the subset of SGLang's native HTTP API that rollflow uses, as recorded in
`tests/fixtures/sglang_protocol.json` (each endpoint's request fields, types and example responses,
with the SGLang source they were read from). Requests are checked against those recorded schemas:
an unknown field, a missing required one or a wrong type is answered with an error, as SGLang's
validation would, so the contract tests catch payload drift.

"Generation" is a deterministic function of (input ids, rid); log-probs are made-up numbers. The
weight-update endpoints record what they received; with `backend: "gloo"` the distributed path
really joins the process group and receives the broadcast tensors (CPU), so the trainer half of
the NCCL path is exercised for real.

Weights: the fake holds real CPU tensors (`weights`, HF names, unfused and unsharded, in the
server's `--dtype`), loaded at startup from `model_path` when it is a directory with *.safetensors
(else empty), and replaced by name by the three update paths (disk: the directory's safetensors;
tensor: each TP rank's own payload, all of which must agree; distributed: the broadcast tensors,
when the gloo group is real). `/get_weights_by_name` serves them as SGLang's Llama-family models do
(and answers 400 for model classes without it, e.g. Qwen2), and `/weights_checker` implements
SGLang's `WeightChecker` actions (snapshot, reset_tensors, compare, checksum) over them under
SGLang's engine names (fused `qkv_proj` / `gate_up_proj`, one shard per TP rank).

The real server's rules, each read from SGLang 0.5.23 (`rules` in the fixture names the source and
the outcome). Where SGLang answers, the fake answers the same: a session opened twice, ended or
updated outside one, a distributed load that fails, is HTTP 400 (the manager returns success=False).
Where SGLang's scheduler raises, the fake DIES: any exception in a scheduler handler reaches
`run_scheduler_process` (sglang/srt/managers/scheduler.py), which SIGQUITs the server and its whole
process tree, so the request never gets an answer and every later one is refused. That is a release
on a busy server (assert), resuming a tag that is not released (KeyError), and a tensor update whose
payload does not load or whose shape does not fit (no try around them). Process mode exits
(SIGKILL, as SGLang's kill_process_tree); in-process the listener closes and open connections drop.
Stricter than SGLang, on purpose: an unknown weight name is a 400 (Qwen2's `load_weights` only logs
it), and TP ranks that receive different tensors are a 400. `/flush_cache` answers 400 while requests
run; abort by rid aborts every request whose rid starts with it. With `own_code=True` (`--own-code`)
every request body is also checked by SGLang's own request structures (tests/sglang_own_code.py),
the tensor payloads are loaded by SGLang's own unpickler, and the session and memory calls go through
SGLang's own `SchedulerWeightUpdaterManager` instead of the fake's copy of its rules; test-only routes
under `/_fake/own/` expose SGLang's argument parser and payload loader to the contract tests.

Use in-process (`with FakeSGLang() as fake: fake.url`) or as a process launched like SGLang
(`python tests/fake_sglang_server.py --model-path M --port P ...`), with test switches
`--die-after N` (exit mid-request on the (N+1)-th /generate), `--die-once-marker PATH` (die only
when PATH does not exist yet, and create it), `--startup-delay S`, `--ignore-update-of NAME`
(repeatable: drop that tensor from every weight update, as an engine whose name mapping misses it
would), `--disable-endpoint PATH` (repeatable: answer 404 there, as an SGLang without it),
`--abort-linger S` (aborted requests keep running S seconds, as a busy scheduler's do) and
`--own-code`.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

PROTOCOL_FILE = Path(__file__).with_name("fixtures") / "sglang_protocol.json"
PROTOCOL = json.loads(PROTOCOL_FILE.read_text())
ENDPOINTS = PROTOCOL["endpoints"]
# How long tests give this fake, run as a process, to answer /health: it imports torch and loads the model, which
# took over 30 s on a fresh-clone CI run with 4 test workers on 2 cores.
FAKE_START_S = 120


# ---------------------------------------------------------------------------------------------
# Recorded-schema checks
# ---------------------------------------------------------------------------------------------


def _type_ok(value: Any, spec: str) -> bool:
    for alt in spec.split("|"):
        if alt == "any":
            return True
        if alt == "null" and value is None:
            return True
        if alt == "str" and isinstance(value, str):
            return True
        if alt == "bool" and isinstance(value, bool):
            return True
        if alt == "int" and isinstance(value, int) and not isinstance(value, bool):
            return True
        if alt == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if alt == "dict" and isinstance(value, dict):
            return True
        if alt == "sampling_params" and isinstance(value, dict):
            return not check_fields(value, ENDPOINTS["sampling_params"], "sampling_params")
        if alt.startswith("list[") and isinstance(value, list):
            inner = alt[5:-1]
            if inner == "base64":
                if all(isinstance(v, str) and _is_b64(v) for v in value):
                    return True
            elif all(_type_ok(v, inner) for v in value):
                return True
    return False


def _is_b64(text: str) -> bool:
    try:
        base64.b64decode(text, validate=True)
        return True
    except ValueError:
        return False


def check_fields(payload: Any, schema: dict, where: str) -> list[str]:
    """Problems of `payload` against a recorded request schema (empty = conforms)."""
    if not isinstance(payload, dict):
        return [f"{where}: body must be a JSON object"]
    errors = []
    fields = schema.get("fields", {})
    for name in schema.get("required", []):
        if name not in payload:
            errors.append(f"{where}: missing required field {name!r}")
    for name, value in payload.items():
        if name not in fields:
            if schema.get("unknown_keys", "rejected") == "rejected":
                errors.append(f"{where}: unknown field {name!r}")
            continue
        if fields[name].startswith("sampling_params") and isinstance(value, dict):
            errors.extend(check_fields(value, ENDPOINTS["sampling_params"], f"{where}.{name}"))
            continue
        if not _type_ok(value, fields[name]):
            errors.append(f"{where}: field {name!r}={value!r} is not {fields[name]}")
    return errors


# ---------------------------------------------------------------------------------------------
# The fake
# ---------------------------------------------------------------------------------------------


class FakeSGLang:
    """In-process fake SGLang server on 127.0.0.1 (port 0 = a free one)."""

    def __init__(
        self,
        *,
        port: int = 0,
        model_path: str = "fake-model",
        tp_size: int = 1,
        vocab_size: int = 15,
        eos_token_id: int = 2,
        weight_version: str = "default",
        step_delay_s: float = 0.0,
        die_after: int | None = None,
        die_once_marker: str | None = None,
        extra_args: list[str] | None = None,
        exit_fn=None,
        ignore_update_of: str | list[str] | tuple[str, ...] = (),
        disable_endpoints: list[str] | tuple[str, ...] = (),
        dtype: str | None = None,
        abort_linger_s: float = 0.0,
        own_code: bool = False,
    ):
        self.model_path = model_path
        self.tp_size = tp_size
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.weight_version = weight_version
        self.step_delay_s = step_delay_s
        self.die_after = die_after
        self.die_once_marker = die_once_marker
        self.extra_args = list(extra_args or [])
        # in-process, dying must not end the test process: the server stops answering instead
        self.exit_fn = exit_fn or self._stop_answering
        self.dead = False
        self.log: list[tuple[str, str, Any]] = []  # (method, path, payload)
        self.memory = {"weights": True, "kv_cache": True}
        self.abort_all_flag = threading.Event()
        self.aborted_rids: set[str] = set()  # prefixes: SGLang aborts every rid starting with one
        self.abort_linger_s = abort_linger_s
        self.session_open = False  # /begin_weight_update ... /end_weight_update
        self.released: set[str] = set()  # memory tags released
        self.flush_attempts = 0
        self.own_checked: list[str] = []  # paths whose body SGLang's own structures judged (own_code)
        self.refusals: list[tuple[str, str]] = []  # (path, message) of every rule the client broke
        self.generated = 0
        self.inflight: set[str] = set()
        self.tensor_updates: list[list[list[tuple[str, tuple, str]]]] = []  # per call: per rank: (name, shape, sha)
        self.disk_updates: list[dict] = []
        self.groups: dict[str, Any] = {}
        self.received: list[tuple[str, tuple, str]] = []  # distributed: (name, shape, sha) in arrival order
        self.ignore_update_of = {ignore_update_of} if isinstance(ignore_update_of, str) else set(ignore_update_of)
        self.disable_endpoints = set(disable_endpoints)
        self.dtype = dtype if dtype not in (None, "auto") else None
        self.architecture = _architecture(model_path)
        self.weights: dict[str, Any] = {n: self._as_served(t) for n, t in _load_safetensors_dir(model_path).items()}
        self.model_shapes = {n: tuple(t.shape) for n, t in self.weights.items()}  # the model's parameters
        # SGLang's tied-embedding models skip lm_head.weight when loading (the head IS the embedding)
        self.tied = _tied_embeddings(model_path)
        self.snapshot: dict[str, Any] | None = None  # /weights_checker snapshot
        # LoRA (--enable-lora): the registry of loaded adapters, every name ever loaded (SGLang's lora_ref_cache,
        # from which a generate naming an unloaded adapter reloads it) and the requests using each adapter
        self.lora_enabled, self.lora_max_rank, self.lora_targets = _lora_flags(self.extra_args)
        self.loras: dict[str, dict] = {}  # name -> {"path", "config", "tensors", "fingerprint"}
        self.lora_ref_cache: dict[str, str] = {}
        self.lora_users: dict[str, int] = {}
        self._base_fp: str | None = None
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread: threading.Thread | None = None
        self.own = None
        if own_code:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            from tests.sglang_own_code import OwnCode

            self.own = OwnCode()
        # SGLang's own session and memory rules (own_code), else the fake's copy of them below
        self.rules = self.own.scheduler_rules(lambda: not self._busy()) if self.own is not None else None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "FakeSGLang":
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> "FakeSGLang":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def calls(self, path: str | None = None) -> list[tuple[str, str, Any]]:
        with self.lock:
            return [c for c in self.log if path is None or c[1] == path]

    def paths(self) -> list[str]:
        with self.lock:
            return [c[1] for c in self.log]

    # -- HTTP plumbing ---------------------------------------------------------------------------
    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt, *args):  # keep test output quiet; the process log gets prints
                pass

            def _body(self) -> Any:
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                return json.loads(raw) if raw else None

            def _send(self, status: int, body: Any = b"", content_type: str = "application/json") -> None:
                if isinstance(body, (dict, list)) or body is None and content_type == "application/json":
                    data = json.dumps(body).encode()
                elif isinstance(body, str):
                    data, content_type = body.encode(), "text/plain; charset=utf-8"
                else:
                    data = body
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._dispatch("GET")

            def do_POST(self):
                self._dispatch("POST")

            def do_PUT(self):
                self._dispatch("PUT")

            def _dispatch(self, method: str) -> None:
                try:
                    self._route(method)
                except SchedulerDied:  # no answer: the connection drops, as a killed server's does
                    self.close_connection = True

            def _route(self, method: str) -> None:
                if fake.dead:  # a kept-alive connection outlives the listener; a dead server answers nothing
                    raise SchedulerDied("dead")
                path = self.path.split("?", 1)[0]
                try:
                    payload = self._body()
                except json.JSONDecodeError as exc:
                    return self._send(400, {"error": f"invalid JSON: {exc}"})
                if path == "/_fake/state" and method == "GET":  # test-only introspection, not SGLang's
                    return self._send(200, fake.state())
                if path.startswith("/_fake/own/"):  # test-only: SGLang's own code, for the contract tests
                    return self._send(*fake.own_route(path, payload or {}))
                spec = ENDPOINTS.get(path)
                if spec is None or path.startswith("_") or path == "sampling_params" or path in fake.disable_endpoints:
                    return self._send(404, {"detail": "Not Found"})
                if method not in spec["methods"]:
                    return self._send(405, {"detail": "Method Not Allowed"})
                with fake.lock:
                    fake.log.append((method, path, payload))
                schema = ENDPOINTS.get(spec.get("alias_of", path), spec)
                if "fields" in schema and (payload is not None or method != "GET"):
                    errors = check_fields(payload if payload is not None else {}, schema, path)
                    if errors:
                        return self._send(schema.get("error_status", 422), {"error": "; ".join(errors)})
                if fake.own is not None and "fields" in schema:
                    errors = fake.own.body_errors(spec.get("alias_of", path), payload)
                    with fake.lock:
                        fake.own_checked.append(path)
                    if errors:
                        with fake.lock:
                            fake.refusals.append((path, "SGLang's own check: " + "; ".join(errors)))
                        return self._send(
                            schema.get("error_status", 422), {"error": "SGLang's own check: " + "; ".join(errors)}
                        )
                handler = getattr(fake, "ep_" + spec.get("alias_of", path).strip("/"))
                status, body = handler(payload or {})
                self._send(status, body)

        return Handler

    def state(self) -> dict:
        with self.lock:
            return {
                "paths": [c[1] for c in self.log],
                "calls": [[m, p, b] for m, p, b in self.log],
                "refusals": [list(r) for r in self.refusals],
                "flush_attempts": self.flush_attempts,
                "own_checked": list(self.own_checked),
                "released": sorted(self.released),
                "session_open": self.session_open,
                "received": [list(r) for r in self.received],
                "tensor_updates": self.tensor_updates,
                "disk_updates": self.disk_updates,
                "weight_version": self.weight_version,
                "memory": dict(self.memory),
                "generated": self.generated,
                "extra_args": self.extra_args,
                "weights": {n: [list(t.shape), _sha(t)] for n, t in self.weights.items()},
                "loras": {n: a["path"] for n, a in self.loras.items()},
            }

    # -- weights held (test helpers, not SGLang's) ----------------------------------------------
    def _as_served(self, t):
        """A CPU copy in the server's --dtype (SGLang casts what it loads to its dtype)."""
        import torch

        t = t.detach().to("cpu")
        if self.dtype is not None and t.dtype.is_floating_point:
            t = t.to(getattr(torch, self.dtype))
        return t.clone()

    def _refuse(self, path: str, message: str, status: int = 400) -> tuple[int, dict]:
        with self.lock:
            self.refusals.append((path, message))
        return status, {"success": False, "message": message}

    def _load_problems(self, named) -> tuple[list[str], list[str]]:
        """(names the model does not have, tensors of another shape than the model's), only checked
        when the fake holds the model's weights. The shape is what the real `weight_loader` asserts."""
        if not self.model_shapes:
            return [], []
        unknown, misfits = [], []
        for name, tensor in named:
            if self.tied and name == "lm_head.weight":
                continue
            shape = self.model_shapes.get(name)
            if shape is None:
                unknown.append(f"unknown parameter {name!r}")
            elif shape != tuple(tensor.shape):
                misfits.append(f"{name}: shape {tuple(tensor.shape)} != the model's {shape}")
        return unknown, misfits

    def _apply_update(self, named) -> list[str]:
        """Store `(name, tensor)` pairs by name (CPU copies in the server's dtype), except the names
        told to ignore. Returns the names dropped."""
        dropped = []
        with self.lock:
            for name, tensor in named:
                if self.tied and name == "lm_head.weight":
                    continue
                if name in self.ignore_update_of:
                    dropped.append(name)
                    continue
                self.weights[name] = self._as_served(tensor)
            self._base_fp = None
        if dropped:
            print(f"fake-sglang: ignored the update of {dropped} (--ignore-update-of)", flush=True)
        return dropped

    def _die(self, path: str, message: str) -> None:
        """What an exception in SGLang's scheduler does to the server: it ends (scheduler.py:
        run_scheduler_process sends SIGQUIT; the launcher kills the process tree). Never returns."""
        with self.lock:
            self.refusals.append((path, message))
            self.dead = True
        print(f"fake-sglang: scheduler exception on {path}: {message}; the server exits, as SGLang's does", flush=True)
        self.exit_fn(-9)
        raise SchedulerDied(message)

    def _stop_answering(self, _code: int) -> None:
        threading.Thread(target=self.stop, daemon=True).start()  # shutdown() waits for serve_forever: not here

    def _sglang_rules(self, path: str, payload) -> tuple[bool, str]:
        """SGLang's own manager decides (own_code): its answer, or the server's death when it raises."""
        try:
            return self.rules.call(self.own.request(path, payload))
        except Exception as exc:  # noqa: BLE001 - whatever SGLang's scheduler raises ends it
            self._die(path, f"{type(exc).__name__}: {exc} (SGLang's own SchedulerWeightUpdaterManager)")
            raise  # unreachable: _die raises

    def _busy(self) -> bool:
        with self.lock:
            return bool(self.inflight)

    def own_route(self, path: str, payload: dict) -> tuple[int, Any]:
        """Test-only: SGLang's own parser / request normalization / payload loader, in this process."""
        if self.own is None:
            return 404, {"detail": "start the fake with own_code=True (--own-code)"}
        try:
            if path == "/_fake/own/server_args":
                return 200, self.own.server_args(payload["argv"])
            if path == "/_fake/own/generate_request":
                return 200, self.own.generate_request(payload["body"])
            if path == "/_fake/own/body_errors":
                return 200, self.own.body_errors(payload["route"], payload["body"])
            if path == "/_fake/own/payload":
                return 200, self.own.payload(
                    payload["data"], load_format=payload.get("load_format"), visible_uuids=payload.get("visible_uuids")
                )
            if path == "/_fake/own/parser_flags":
                from rollflow.tasks.rollout.sglang.flags import live_parser_flags

                return 200, live_parser_flags()
            if path == "/_fake/own/release_while_busy":  # a scratch manager: this server's own stays as it is
                scratch = self.own.scheduler_rules(lambda: False)
                try:
                    scratch.call(self.own.request("/release_memory_occupation", {"tags": ["kv_cache"]}))
                except Exception as exc:  # noqa: BLE001 - what the scheduler would die of
                    return 200, {"raised": f"{type(exc).__name__}: {exc}"}
                return 200, {"raised": None}
            if path == "/_fake/own/version":
                return 200, {"version": self.own.version}
        except SystemExit as exc:  # argparse refusing a command line
            return 400, {"error": f"SGLang's parser exited ({exc.code})"}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return 400, {"error": f"{type(exc).__name__}: {exc}"}
        return 404, {"detail": "Not Found"}

    # -- endpoints -------------------------------------------------------------------------------
    def ep_health(self, _):
        return 200, b""

    def ep_health_generate(self, _):
        return (200, b"") if all(self.memory.values()) else (503, b"")

    def ep_flush_cache(self, _):
        with self.lock:
            self.flush_attempts += 1
        if self._busy():  # SGLang flushes only an idle server
            return 400, "Cache not flushed: there are running or waiting requests.\n"
        return 200, ENDPOINTS["/flush_cache"]["example_response"]["body"]

    def ep_model_info(self, _):
        return 200, {
            **ENDPOINTS["/model_info"]["example_response"],
            "model_path": self.model_path,
            "served_model_name": self.model_path,
            "tokenizer_path": self.model_path,
            "weight_version": self.weight_version,
        }

    def ep_server_info(self, _):
        return 200, {
            **ENDPOINTS["/server_info"]["example_response"],
            "model_path": self.model_path,
            "tp_size": self.tp_size,
            "port": self.port,
            "fake": True,
            "extra_args": self.extra_args,
        }

    def ep_abort_request(self, payload):
        if payload.get("abort_all"):
            self.abort_all_flag.set()
        elif payload.get("rid"):
            with self.lock:
                self.aborted_rids.add(payload["rid"])  # a prefix, as SGLang matches it
        return 200, b""

    def _aborted(self, rid: str) -> bool:
        with self.lock:
            return self.abort_all_flag.is_set() or any(rid.startswith(p) for p in self.aborted_rids)

    def ep_release_memory_occupation(self, payload):
        if self.rules is not None:
            self._sglang_rules("/release_memory_occupation", payload)
        elif self._busy():  # scheduler_components/weight_updater.py: release_memory_occupation asserts idle
            self._die(
                "/release_memory_occupation",
                "AssertionError: release_memory_occupation should be called only when server is idle.",
            )
        for tag in payload.get("tags") or MEMORY_TAGS:
            self.memory[tag] = False
            self.released.add(tag)
        return 200, None

    def ep_resume_memory_occupation(self, payload):
        tags = payload.get("tags") or MEMORY_TAGS
        if self.rules is not None:
            self._sglang_rules("/resume_memory_occupation", payload)
        missing = [t for t in tags if t not in self.released]
        if missing:  # scheduler_components/weight_updater.py: resume_memory_occupation, `offload_tags.remove(tag)`
            self._die("/resume_memory_occupation", f"KeyError: {missing[0]!r}")
        for tag in tags:
            self.memory[tag] = True
            self.released.discard(tag)
        return 200, None

    # The session rules answer (SchedulerWeightUpdaterManager.begin_weight_update / end_weight_update /
    # update_weights_from_tensor / update_weights_from_distributed return success=False; http_server.py
    # maps it to 400): the server lives on.
    def _session_gate(self, path: str, payload, allowed: bool, message: str) -> tuple[int, dict] | None:
        if self.rules is not None:
            ok, message = self._sglang_rules(path, payload)
            self.session_open = self.rules.session_open
        else:
            ok = allowed
        return None if ok else self._refuse(path, message)

    def ep_begin_weight_update(self, payload):
        refused = self._session_gate(
            "/begin_weight_update",
            payload,
            not self.session_open,
            "a weight-update session is already open; call end_weight_update() first",
        )
        if refused:
            return refused
        self.session_open = True
        return 200, {"success": True, "message": "Success"}

    def ep_end_weight_update(self, payload):
        refused = self._session_gate(
            "/end_weight_update",
            payload,
            self.session_open,
            "no weight-update session is open; call begin_weight_update() first",
        )
        if refused:
            return refused
        self.session_open = False
        return 200, {"success": True, "message": "Success"}

    def ep_update_weights_from_disk(self, payload):
        path = Path(payload["model_path"])
        has_weights = any(path.glob("*.safetensors"))
        if not (path / "config.json").exists() or not has_weights:
            return 400, {
                "success": False,
                "message": f"{path}: no config.json + *.safetensors",
                "num_paused_requests": 0,
            }
        loaded = _load_safetensors_dir(path)
        problems = sum(self._load_problems(loaded.items()), [])  # the disk path catches load errors: 400
        if problems:
            return self._refuse("/update_weights_from_disk", "; ".join(problems))
        self.disk_updates.append({"model_path": str(path), "files": sorted(p.name for p in path.iterdir())})
        self._apply_update(loaded.items())
        if payload.get("weight_version") is not None:
            self.weight_version = payload["weight_version"]
        return 200, ENDPOINTS["/update_weights_from_disk"]["example_response"]

    def ep_update_weights_from_tensor(self, payload):
        refused = self._session_gate(
            "/update_weights_from_tensor",
            payload,
            self.session_open,
            "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()",
        )
        if refused:
            return refused
        ranks = payload["serialized_named_tensors"]
        if len(ranks) != self.tp_size:
            return 400, {"success": False, "message": f"{len(ranks)} payloads for tp_size {self.tp_size}"}
        per_rank, rank0 = [], None
        for data in ranks:  # each TP rank loads only its own payload (tp_worker.deserialize_own_rank)
            try:
                named = self._load_payload(data, payload.get("load_format"))
            except Exception as exc:  # noqa: BLE001 - deserialize_own_rank has no try: the scheduler dies
                self._die("/update_weights_from_tensor", f"{type(exc).__name__}: {exc}")
            per_rank.append([(n, tuple(t.shape), _sha(t)) for n, t in named])
            rank0 = named if rank0 is None else rank0
        unknown, misfits = self._load_problems(rank0 or [])
        if misfits:  # the model's weight_loader asserts the shape, unguarded on the tensor path: the scheduler dies
            self._die("/update_weights_from_tensor", "AssertionError: " + "; ".join(misfits))
        if any(r != per_rank[0] for r in per_rank):
            return self._refuse("/update_weights_from_tensor", "TP ranks received different tensors")
        if unknown:
            return self._refuse("/update_weights_from_tensor", "; ".join(unknown))
        self.tensor_updates.append(per_rank)
        self._apply_update(rank0 or [])
        if payload.get("weight_version") is not None:
            self.weight_version = payload["weight_version"]
        return 200, ENDPOINTS["/update_weights_from_tensor"]["example_response"]

    def ep_init_weights_update_group(self, payload):
        group = payload.get("group_name", "weight_update_group")
        entry = {"payload": payload, "pg": None}
        if payload.get("backend") == "gloo":  # CPU: really join, as rank rank_offset (tp rank 0)
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            from rollflow.tasks.sync.weight_group import init_weight_group

            entry["pg"] = init_weight_group(
                payload["master_address"],
                payload["master_port"],
                rank=payload["rank_offset"],
                world_size=payload["world_size"],
                group_name=group,
                backend="gloo",
                timeout_s=60,
            )
        self.groups[group] = entry
        return 200, ENDPOINTS["/init_weights_update_group"]["example_response"]

    def _load_payload(self, data: str, load_format: str | None) -> list:
        """One rank's payload: through SGLang's own unpickler with own_code, else rollflow's (both map
        a flattened bucket back to named tensors)."""
        if self.own is not None:
            return self.own.load_named(data, load_format=load_format)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from rollflow.tasks.sync.ipc import deserialize_named_tensors

        named = deserialize_named_tensors(base64.b64decode(data))
        if (load_format == "flattened_bucket") != _is_flat(data):
            raise ValueError(f"load_format={load_format!r} does not match the payload")
        return named

    def ep_update_weights_from_distributed(self, payload):
        refused = self._session_gate(
            "/update_weights_from_distributed",
            payload,
            self.session_open,
            "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()",
        )
        if refused:
            return refused
        # load_weights_from_distributed catches the model's errors (success=False, 400): the server lives on
        problems = sum(self._load_problems([(n, _Shape(s)) for n, s in zip(payload["names"], payload["shapes"])]), [])
        if problems:
            return self._refuse("/update_weights_from_distributed", "; ".join(problems))
        group = payload.get("group_name", "weight_update_group")
        if group not in self.groups:
            return 400, {
                "success": False,
                "message": f"Group {group} not in {list(self.groups)}. Please call `init_weights_update_group` first.",
            }
        pg = self.groups[group]["pg"]
        for name, dtype, shape in zip(payload["names"], payload["dtypes"], payload["shapes"]):
            if pg is not None:
                import torch
                import torch.distributed as dist

                t = torch.empty(shape, dtype=getattr(torch, dtype))
                dist.broadcast(t, src=0, group=pg)
                self.received.append((name, tuple(shape), _sha(t)))
                self._apply_update([(name, t)])
            else:
                self.received.append((name, tuple(shape), ""))
        if payload.get("weight_version") is not None:
            self.weight_version = payload["weight_version"]
        return 200, ENDPOINTS["/update_weights_from_distributed"]["example_response"]

    def ep_destroy_weights_update_group(self, payload):
        group = payload.get("group_name", "weight_update_group")
        entry = self.groups.pop(group, None)
        if entry and entry["pg"] is not None:
            import torch.distributed as dist

            dist.destroy_process_group(entry["pg"])
        return 200, ENDPOINTS["/destroy_weights_update_group"]["example_response"]

    # -- LoRA adapters (SGLang 0.5.23: tokenizer_control_mixin.py, lora/lora_manager.py, lora/lora_registry.py) --
    def _lora_refuse(self, path: str, message: str) -> tuple[int, dict]:
        with self.lock:
            self.refusals.append((path, message))
        return 400, {"success": False, "error_message": message, "loaded_adapters": None}

    def _lora_answer(self) -> tuple[int, dict]:
        return 200, {"success": True, "error_message": None, "loaded_adapters": self._loaded_adapters()}

    def _loaded_adapters(self) -> dict[str, str]:
        with self.lock:
            return {n: a["path"] for n, a in self.loras.items()}

    def ep_load_lora_adapter(self, payload):
        path = "/load_lora_adapter"
        if not self.lora_enabled:
            return self._lora_refuse(path, LORA_NOT_ENABLED)
        directory = Path(payload["lora_path"])
        try:  # LoRAConfig + LoRAAdapter.initialize_weights, inside the manager's try: a failure is success=False
            if not directory.is_dir():  # SGLang would try the Hub (snapshot_download); nothing is reachable here
                raise OSError(f"{directory} is not a directory (and the fake reaches no model hub)")
            config = json.loads((directory / "adapter_config.json").read_text())
            tensors = _load_safetensors_dir(directory)
        except (OSError, ValueError) as exc:
            return self._lora_refuse(path, str(exc))
        return self._register_lora(path, payload["lora_name"], str(directory), config, tensors)

    def ep_load_lora_adapter_from_tensors(self, payload):
        path = "/load_lora_adapter_from_tensors"
        if not self.lora_enabled:
            return self._lora_refuse(path, LORA_NOT_ENABLED)
        ranks = payload["serialized_named_tensors"]
        if len(ranks) < self.tp_size:  # rank r reads serialized_named_tensors[r], unguarded in the scheduler
            self._die(path, f"IndexError: list index out of range ({len(ranks)} payloads for tp_size {self.tp_size})")
        per_rank = []
        for data in ranks[: self.tp_size]:  # tp_worker.load_lora_adapter_from_tensors: no try around the load
            try:
                named = self._load_payload(data, payload.get("load_format"))
            except Exception as exc:  # noqa: BLE001 - the scheduler dies of it
                self._die(path, f"{type(exc).__name__}: {exc}")
            per_rank.append(named)
        expected = payload.get("expected_checksums")
        if expected is not None:  # tp_worker's [LORA-CHECK]: a RuntimeError in the scheduler
            got = {n: hashlib.sha256(_raw(t)).hexdigest() for n, t in per_rank[0]}
            if got != expected:
                self._die(path, "RuntimeError: [LORA-CHECK] adapter sync MISMATCH")
        digests = [[(n, _sha(t)) for n, t in named] for named in per_rank]
        if any(d != digests[0] for d in digests):  # stricter than SGLang, as for the tensor weight path
            return self._lora_refuse(path, "TP ranks received different adapter tensors")
        return self._register_lora(path, payload["lora_name"], "__tensor__", payload["config_dict"], dict(per_rank[0]))

    def _register_lora(self, path: str, name: str, lora_path: str, config: dict, tensors: dict) -> tuple[int, dict]:
        """lora_manager._load_lora_adapter*: LoRAConfig, validate_new_adapter, the weights; any error there is
        caught (success=False, HTTP 400)."""
        try:
            rank, alpha, targets = int(config["r"]), float(config["lora_alpha"]), list(config["target_modules"])
        except KeyError as exc:
            return self._lora_refuse(path, f"adapter_config has no {exc}")
        if config.get("use_dora"):
            return self._lora_refuse(
                path, f"Failed to load {name} because LoRA serving currently doesn't support DoRA adapters"
            )
        with self.lock:
            loaded = name in self.loras
        if loaded:
            return self._lora_refuse(path, f"Failed to load LoRA adapter {name} because it is already loaded")
        if rank > (self.lora_max_rank or 0) or not (
            "all" in self.lora_targets or set(targets) <= set(self.lora_targets)
        ):
            return self._lora_refuse(
                path,
                f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA memory pool "
                "configuration. Please ensure that the LoRA adapter's rank is within the configured "
                "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`.",
            )
        problems = self._lora_problems(tensors, rank, targets)  # stricter: SGLang skips names it cannot place
        if problems:
            return self._lora_refuse(path, "; ".join(problems[:3]))
        adapter = {"path": lora_path, "config": dict(config), "scaling": alpha / rank}
        adapter["tensors"] = {n: t.detach().to("cpu").clone() for n, t in tensors.items()}
        adapter["fingerprint"] = self._fingerprint(self._merged_with(adapter))
        with self.lock:
            self.loras[name] = adapter
            self.lora_ref_cache[name] = lora_path
        return self._lora_answer()

    def _lora_problems(self, tensors: dict, rank: int, targets: list[str]) -> list[str]:
        """Every tensor is a PEFT `...<module>.lora_A.weight` / `lora_B.weight` of a target module the model
        has, A [r, in] and B [out, r] against the module's weight [out, in]."""
        problems = []
        for name, t in tensors.items():
            module, part = _lora_module(name)
            if module is None or module.rsplit(".", 1)[-1] not in targets:
                problems.append(f"{name}: not a lora_A / lora_B weight of a target module")
                continue
            base = self.weights.get(f"{module}.weight")
            if base is None:
                if self.model_shapes:
                    problems.append(f"{name}: the model has no {module}.weight")
                continue
            want = (rank, base.shape[1]) if part == "A" else (base.shape[0], rank)
            if tuple(t.shape) != want:
                problems.append(f"{name}: shape {tuple(t.shape)} != {want}")
        return problems

    def _merged_with(self, adapter: dict) -> dict:
        """The weights a request naming this adapter computes with: W + scaling * B @ A per adapted module."""
        out = dict(self.weights)
        for name, a in adapter["tensors"].items():
            module, part = _lora_module(name)
            if part != "A" or f"{module}.weight" not in out:
                continue
            b = adapter["tensors"][name.replace(".lora_A.", ".lora_B.")]
            w = self.weights[f"{module}.weight"]
            out[f"{module}.weight"] = (w.float() + (b.float() @ a.float()) * adapter["scaling"]).to(w.dtype)
        return out

    def lora_served(self, name: str | None) -> dict:
        """Test helper: the weights a request naming `name` (None: no adapter) is served with."""
        with self.lock:
            adapter = self.loras.get(name) if name else None
        return dict(self.weights) if adapter is None else self._merged_with(adapter)

    def _served_fingerprint(self, lora: str | None) -> str:
        with self.lock:
            if lora:
                return self.loras[lora]["fingerprint"]
            if self._base_fp is None:
                self._base_fp = self._fingerprint(self.weights)
            return self._base_fp

    def _fingerprint(self, weights: dict) -> str:
        # a tied head is the embedding (SGLang never loads lm_head.weight there): only the held tensors count
        return _fingerprint({n: t for n, t in weights.items() if not (self.tied and n == "lm_head.weight")})

    def ep_unload_lora_adapter(self, payload):
        path = "/unload_lora_adapter"
        if not self.lora_enabled:
            return self._lora_refuse(path, LORA_NOT_ENABLED)
        name = payload["lora_name"]
        with self.lock:
            known = name in self.loras
        if not known:
            return self._lora_refuse(
                path, f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self._loaded_adapters())}"
            )
        deadline = time.monotonic() + 60  # lora_registry.wait_for_unload: after the requests using it
        while self.lora_users.get(name, 0) > 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        with self.lock:
            self.loras.pop(name, None)
        return self._lora_answer()

    def _resolve_loras(self, names: set[str]) -> str | None:
        """tokenizer_manager._validate_and_resolve_lora: the error message of a refused generate, or None."""
        if not self.lora_enabled:
            first = sorted(names)[0]
            return (
                f"LoRA adapter '{first}' was requested, but LoRA is not enabled. Please launch the server with "
                "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
            )
        for name in sorted(names):
            with self.lock:
                loaded, cached = name in self.loras, self.lora_ref_cache.get(name)
            if loaded:
                continue
            if cached is None:
                cache = list(self.lora_ref_cache)
                return f"Got LoRA adapter that has never been loaded: {name}\nAll loaded adapters: {cache}."
            # an unloaded adapter is loaded again from its path (a tensor load's `__tensor__` cannot be)
            status, body = self.ep_load_lora_adapter({"lora_name": name, "lora_path": cached})
            if status != 200:
                return f"Failed to implicitly load LoRA adapter {name}: {body['error_message']}"
        return None

    def ep_update_weight_version(self, payload):
        if payload.get("abort_all_requests", True):
            self.abort_all_flag.set()
        self.weight_version = payload["new_version"]
        return 200, {
            "success": True,
            "message": f"Weight version updated to {payload['new_version']}",
            "new_version": payload["new_version"],
        }

    def ep_get_weights_by_name(self, payload):
        """SGLang's Llama-family `get_weights_by_name` at tp 1: the tensor as float32 `.tolist()`, cut to
        the first `truncate_size` entries of its first dimension (rows of a 2-D tensor); an unknown
        name is the handler's 400 "Get parameter by name failed"."""
        import torch

        if self.architecture and self.architecture not in GET_WEIGHTS_BY_NAME_MODELS:
            return 400, {"error": {"message": "Get parameter by name failed"}}  # the model class has none
        with self.lock:
            t = self.weights.get(payload.get("name"))
        if t is None:
            return 400, {"error": {"message": "Get parameter by name failed"}}
        values = t.to(torch.float32).reshape(-1 if t.dim() == 0 else t.shape).tolist()
        return 200, values[: payload.get("truncate_size", 100)]

    def ep_weights_checker(self, payload):
        """SGLang's `WeightChecker.handle` over the held weights; a failure is HTTP 400 with
        success false and the exception text as message (http_server.py: check_weights)."""
        action = payload.get("action", "checksum")
        skip = payload.get("skip_tensor_list") or ()
        try:
            with self.lock:
                if action == "snapshot":
                    self.snapshot = {n: t.clone() for n, t in self._engine_named().items()}
                    extra = {}
                elif action == "reset_tensors":
                    for name in list(self.weights):
                        if not any(p in name for p in skip):
                            self.weights[name] = _random_like(self.weights[name])
                    extra = {}
                elif action == "compare":
                    self._compare(skip)
                    extra = {}
                elif action == "checksum":
                    extra = self._checksum(skip)
                else:
                    raise Exception(f"Unsupported {action=}")
        except Exception as exc:  # noqa: BLE001 - SGLang answers with str(exception)
            return 400, {"success": False, "message": f"{exc}"}
        return 200, {"success": True, "message": "Success.", **extra}

    def _engine_named(self) -> dict:
        """The held weights under SGLang's parameter names: q/k/v fused into `qkv_proj`, gate/up into
        `gate_up_proj` (dim 0, in that order); a tied model has no separate lm_head."""
        import torch

        out, fused = {}, {}
        for name, t in self.weights.items():
            if self.tied and name == "lm_head.weight":
                continue
            for hf, engine, part in FUSED:
                if f".{hf}." in name:
                    fused.setdefault(name.replace(f".{hf}.", f".{engine}."), {})[part] = t
                    break
            else:
                out[name] = t
        for name, parts in fused.items():
            out[name] = torch.cat([parts[i] for i in sorted(parts)], dim=0)
        return out

    def _compare(self, skip) -> None:
        """Every snapshot tensor against the current one, value-exact; SGLang's message format. A
        compare that passes consumes the snapshot (0.5.23); without one it is SGLang's bare assert."""
        assert self.snapshot is not None
        errors = []
        current = self._engine_named()
        names = list(self.snapshot) + [n for n in current if n not in self.snapshot]
        for name in names:
            if any(p in name for p in skip):
                continue
            expect, actual = self.snapshot.get(name), current.get(name)
            if expect is not None and actual is not None and expect.shape == actual.shape:
                diff = (actual.float() - expect.float()).abs()  # SGLang: equal iff every |diff| is 0
                exceed = int((~(diff <= 0)).sum())  # `~(diff <= tol)`: NaN counts too
                if exceed == 0:
                    continue
                max_err, mean_err = diff.max().item(), diff.sum().item() / max(diff.numel(), 1)
            else:  # SGLang fails an assert here (name order or shape); the fake names the tensor instead
                max_err, mean_err, exceed = float("nan"), float("nan"), -1
            errors.append(
                f"name={name} max_abs_err={max_err} mean_abs_err={mean_err} num_exceed={exceed} "
                f"expect={_raw_repr(expect)} actual={_raw_repr(actual)} "
            )
        if errors:
            raise Exception("check tensor equality failed:\n" + "\n".join(errors))
        self.snapshot = None

    def _checksum(self, skip) -> dict:
        """SGLang 0.5.23's body: `ranks` (one ChecksumInfo per TP rank) and `per_engine_checksum`. The
        fake cuts every tensor along dim 0 into tp_size shards, so TP ranks hash different bytes."""
        ranks = []
        engine_named = self._engine_named()
        for tp_rank in range(self.tp_size):
            sums = {}
            for name, t in engine_named.items():
                if any(p in name for p in skip):
                    continue
                shard = t.chunk(self.tp_size)[tp_rank] if t.dim() and t.shape[0] >= self.tp_size else t
                sums[name] = _sha(shard)
            overall = hashlib.sha256()
            for name in sorted(sums):
                overall.update(name.encode())
                overall.update(sums[name].encode())
            info = {
                "role": "target",
                "tp_rank": tp_rank,
                "tp_size": self.tp_size,
                "dp_rank": 0,
                "dp_size": 1,
                "pp_rank": 0,
                "pp_size": 1,
                "rank": tp_rank,
                "size": self.tp_size,
            }
            ranks.append({"checksums": sums, "per_gpu_checksum": overall.hexdigest(), "parallelism_info": [info]})
        engine = hashlib.sha256()
        for info in ranks:
            engine.update(info["per_gpu_checksum"].encode())
        return {"ranks": ranks, "per_engine_checksum": engine.hexdigest()}

    def ep_generate(self, payload):
        if not all(self.memory.values()):
            released = [t for t, on in self.memory.items() if not on]
            return 400, {"error": {"message": f"memory released ({released}); resume_memory_occupation first"}}
        with self.lock:
            count = self.generated
            self.generated += 1
        if self.die_after is not None and count >= self.die_after:
            marker = Path(self.die_once_marker) if self.die_once_marker else None
            if marker is None or not marker.exists():
                if marker is not None:
                    marker.write_text("died once\n")
                print(
                    f"fake-sglang: exiting mid-request on /generate #{count + 1} (--die-after {self.die_after})",
                    flush=True,
                )
                self.exit_fn(17)
        batch = payload["input_ids"] and isinstance(payload["input_ids"][0], list)
        prompts = payload["input_ids"] if batch else [payload["input_ids"]]
        sps = payload.get("sampling_params") or {}
        sps = sps if isinstance(sps, list) else [sps] * len(prompts)
        n = sps[0].get("n", 1)
        lora = payload.get("lora_path")
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        if any(loras):
            error = self._resolve_loras({x for x in loras if x})
            if error:
                return 400, {"error": {"message": error}}
        rid = payload.get("rid") or f"fake-{count}"
        # SGLang's rids (GenerateReqInput._normalize_rid): a list names each prompt; a string is the
        # prompt's own rid (one prompt, n == 1) or the prefix of `rid_i` children
        outs = []
        for p_idx, ids in enumerate(prompts):
            for j in range(n):
                if isinstance(rid, list):
                    sub = rid[p_idx] if n == 1 else f"{rid[p_idx]}_{j}"
                else:
                    sub = rid if (len(prompts) == 1 and n == 1) else f"{rid}_{p_idx * n + j}"
                outs.append(self._one(ids, sps[p_idx], sub, loras[p_idx]))
        return 200, outs if (batch or n > 1) else outs[0]

    def _one(self, ids: list[int], sp: dict, rid: str, lora: str | None = None) -> dict:
        max_new = int(sp.get("max_new_tokens", 128))
        stops = set(sp.get("stop_token_ids") or []) | {self.eos_token_id}
        served = ""
        if self.lora_enabled:  # a LoRA server's tokens follow the weights it serves: base, or base + adapter
            served = "|" + self._served_fingerprint(lora)
        seed = int(hashlib.sha256(f"{ids}|{rid}|{sp.get('sampling_seed')}{served}".encode()).hexdigest()[:8], 16)
        tokens, logprobs, finish = [], [], None
        with self.lock:
            self.inflight.add(rid)
            if lora:
                self.lora_users[lora] = self.lora_users.get(lora, 0) + 1
        try:
            for i in range(max_new):
                if self._aborted(rid):
                    finish = {
                        "type": "abort",
                        "message": "Abort in waiting queue",
                        "status_code": None,
                        "err_type": None,
                    }
                    time.sleep(self.abort_linger_s)  # a busy scheduler finishes aborting later
                    break
                if self.step_delay_s:
                    time.sleep(self.step_delay_s)
                tok = 3 + (seed // (i + 1) + 7 * i) % max(1, self.vocab_size - 3)
                if i == max_new - 2 and seed % 3 == 0:
                    tok = self.eos_token_id  # some samples stop early
                tokens.append(tok)
                logprobs.append(-0.25 - 0.01 * i)
                if tok in stops:
                    finish = {"type": "stop", "matched": tok}
                    break
        finally:
            with self.lock:
                self.inflight.discard(rid)
                if lora:
                    self.lora_users[lora] -= 1
        if finish is None:
            finish = {"type": "length", "length": max_new}
        meta = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "weight_version": self.weight_version,
            "num_retractions": 0,
            "completion_tokens": len(tokens),
            "cached_tokens": 0,
            "reasoning_tokens": 0,
            "e2e_latency": 0.001,
        }
        if sp is not None:
            meta["input_token_logprobs"] = [[None, ids[0], None]] if ids else []
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs, tokens)]
            meta["output_token_logprobs_length"] = len(tokens)
        return {"output_ids": tokens, "meta_info": meta}


MEMORY_TAGS = ["kv_cache", "weights", "cuda_graph"]  # sglang/srt/constants.py GPU_MEMORY_ALL_TYPES
# SGLang 0.5.23 model classes with get_weights_by_name (sglang/srt/models/*.py; subclasses of Llama's too)
GET_WEIGHTS_BY_NAME_MODELS = {
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "OPTForCausalLM",
    "GraniteForCausalLM",
    "Exaone4ForCausalLM",
}
# HF projection -> SGLang's fused parameter, and its place in the fusion (dim 0)
FUSED = [
    ("q_proj", "qkv_proj", 0),
    ("k_proj", "qkv_proj", 1),
    ("v_proj", "qkv_proj", 2),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
]


LORA_NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


def _lora_flags(argv: list[str]) -> tuple[bool, int | None, list[str]]:
    """--enable-lora, --max-lora-rank N, --lora-target-modules M... from a launch command line."""
    enabled, rank, targets = "--enable-lora" in argv, None, []
    for i, item in enumerate(argv):
        if item == "--max-lora-rank":
            rank = int(argv[i + 1])
        elif item == "--lora-target-modules":
            for value in argv[i + 1 :]:
                if value.startswith("--"):
                    break
                targets.append(value)
    return enabled, rank, targets


def _lora_module(name: str) -> tuple[str | None, str | None]:
    """`base_model.model.<module>.lora_A.weight` -> (<module>, "A"); (None, None) for anything else."""
    for part in ("A", "B"):
        suffix = f".lora_{part}.weight"
        if name.endswith(suffix):
            return name.removeprefix("base_model.model.").removesuffix(suffix), part
    return None, None


def _raw(t) -> bytes:
    import torch

    return t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()


def _fingerprint(weights: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(_sha(weights[name]).encode())
    return h.hexdigest()[:16]


class SchedulerDied(Exception):
    """Raised through a handler when the fake dies, so its request gets no answer."""


class _Shape:
    """A shape in a tensor's place (distributed updates announce shapes before the bytes)."""

    def __init__(self, shape):
        self.shape = tuple(shape)


def _is_flat(data: str) -> bool:
    return b"FlattenedTensorMetadata" in base64.b64decode(data)


def _architecture(model_path: str) -> str | None:
    try:
        archs = json.loads((Path(model_path) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return None
    return archs[0] if archs else None


def _tied_embeddings(model_path: str) -> bool:
    try:
        return bool(json.loads((Path(model_path) / "config.json").read_text()).get("tie_word_embeddings"))
    except (OSError, ValueError):
        return False


def _sha(t) -> str:
    """First 16 hex of sha256 over the raw bytes (any dtype, bf16 included)."""
    import torch

    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:16]


def _load_safetensors_dir(path) -> dict[str, Any]:
    """All tensors of `path`/*.safetensors (sorted file order), or {} when it is not such a directory."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        return {}
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def _random_like(t):
    """SGLang's `_random_like`: uniform [0, 1) for floats, random bits for bool/int tensors."""
    import torch

    if t.dtype.is_floating_point:
        return torch.rand(t.shape, dtype=torch.float32).to(t.dtype)
    if t.dtype == torch.bool:
        return torch.rand(t.shape) > 0.5
    info = torch.iinfo(t.dtype)
    return torch.randint(int(info.min), int(info.max), t.shape, dtype=t.dtype)


def _raw_repr(t) -> str:
    return "missing" if t is None else f"raw(shape={tuple(t.shape)} dtype={t.dtype})"


# ---------------------------------------------------------------------------------------------
# Process mode: parse the command line rollflow generates for `python -m sglang.launch_server`
# ---------------------------------------------------------------------------------------------


def _exit_process(code: int) -> None:
    if code == -9:  # a scheduler death: SGLang's kill_process_tree SIGKILLs the server
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="FAKE SGLang server (tests only)")
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--weight-version", default="default")
    ap.add_argument("--die-after", type=int, default=None)
    ap.add_argument("--die-once-marker", default=None)
    ap.add_argument("--startup-delay", type=float, default=0.0)
    ap.add_argument("--step-delay", type=float, default=0.0)
    ap.add_argument("--ignore-update-of", action="append", default=[], metavar="NAME")
    ap.add_argument("--disable-endpoint", action="append", default=[], metavar="PATH")
    ap.add_argument("--abort-linger", type=float, default=0.0)
    ap.add_argument("--own-code", action="store_true")
    args, extra = ap.parse_known_args(argv)
    dtype = extra[extra.index("--dtype") + 1] if "--dtype" in extra else None  # SGLang's flag, passed on
    if args.host != "127.0.0.1":
        print(f"fake-sglang: refusing host {args.host}: loopback only", flush=True)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from rollflow.tasks.rollout.sglang.flags import check_flag

    for item in extra:  # the rest must be real SGLang flags (values pass through)
        if item.startswith("--"):
            check_flag(item.split("=", 1)[0])
    vocab, eos = 15, 2
    config = Path(args.model_path) / "config.json"
    if config.exists():
        cfg = json.loads(config.read_text())
        vocab, eos = int(cfg.get("vocab_size", vocab)), int(cfg.get("eos_token_id", eos) or eos)
    print(f"fake-sglang (NOT SGLang): model {args.model_path}, tp {args.tp_size}, extra {extra}", flush=True)
    time.sleep(args.startup_delay)
    fake = FakeSGLang(
        port=args.port,
        model_path=args.model_path,
        tp_size=args.tp_size,
        vocab_size=vocab,
        eos_token_id=eos,
        weight_version=args.weight_version,
        step_delay_s=args.step_delay,
        die_after=args.die_after,
        die_once_marker=args.die_once_marker,
        extra_args=extra,
        ignore_update_of=args.ignore_update_of,
        disable_endpoints=args.disable_endpoint,
        dtype=dtype,
        abort_linger_s=args.abort_linger,
        own_code=args.own_code,
        exit_fn=_exit_process,
    )
    print(f"fake-sglang: serving on {fake.url}", flush=True)
    try:
        fake.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: (print("fake-sglang: SIGTERM, exiting", flush=True), os._exit(0)))
    sys.exit(main())
