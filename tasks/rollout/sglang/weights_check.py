"""Whole-tensor weight checks of SGLang engines through SGLang's `/weights_checker` endpoint.

`/get_weights_by_name` serves the first values of a tensor, and only for the model classes that
implement it (in SGLang 0.5.23 Qwen2ForCausalLM does not: every name answers 400). SGLang's
`WeightChecker` (sglang/srt/utils/weight_checker.py) works on every model, over the engine's own
parameters and buffers (fused qkv/gate_up, TP shards), whole:

- `snapshot`: copy every parameter and buffer to CPU;
- `reset_tensors`: overwrite every one with random values;
- `compare`: value-exact against the snapshot (failure: HTTP 400, success false, one
  `name=... max_abs_err=... mean_abs_err=...` line per differing tensor);
- `checksum`: a hash per tensor and per GPU.

`verify_update_overwrites_all` is slime's `--check-weight-update-equal`: snapshot, reset, push the
trainer's weights, compare. Because every tensor was randomised, compare passes only if the push
overwrote EVERY engine tensor with exactly the bytes the engine loaded from its checkpoint, which
checks the whole name mapping, fusing and sharding at once. That is valid only while the trainer
holds that same checkpoint (before the first optimizer step); a failed check leaves random values in
the engine, so the caller must stop or re-sync. `engine_checksums` + `compare_engines` check, at any
time, that every server of an engine holds identical tensors (one server that missed an update).

Plain functions over a `rollflow.tasks.rollout.sglang.engine.SGLangEngine`; no Ray, Prefect or SGLang needed.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import re
from typing import Any, Callable, Mapping, Sequence

from rollflow.tasks.rollout.sglang.payloads import SGLangRequestError

PATH = "/weights_checker"
ACTIONS = ("snapshot", "reset_tensors", "compare", "checksum")
MISSING_HINT = (
    "this SGLang has no /weights_checker (SGLang 0.5.23 has it): upgrade SGLang, or turn the "
    "whole-tensor weight check off"
)

# One line per differing tensor in WeightChecker._check_tensors (the message may join several DP
# ranks' messages with " | "; the names never contain spaces).
_MISMATCH = re.compile(
    r"name=(?P<name>\S+) max_abs_err=(?P<max>\S+) mean_abs_err=(?P<mean>\S+)"
    r"(?: num_exceed=(?P<exceed>-?\d+))?"
)


class WeightsCheckerMissing(SGLangRequestError):
    """The server has no /weights_checker (HTTP 404)."""


class WeightsCheckError(SGLangRequestError):
    """A /weights_checker action failed where failure is not a verdict (snapshot, reset_tensors,
    checksum), or the server answered something that is not a weights-checker result."""


# ----------------------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------------------


def check_weights(
    engine,
    action: str,
    *,
    skip_tensor_list: Sequence[str] | None = None,
    allow_quant_error: bool | None = None,
    timeout: float | None = None,
) -> list[dict]:
    """POST /weights_checker {"action": action} to every server of `engine`; one response body per
    URL, in `engine.urls` order.

    A failed action (HTTP 400 with `success: false`) is returned, not raised: for `compare` it is the
    verdict. Raised: `WeightsCheckerMissing` on 404, `SGLangRequestError` on another status or a body
    that is no checker result, `EngineDiedError` (with the log tail) when a launched server is gone.
    `skip_tensor_list` (substrings of engine names) and `allow_quant_error` are sent only when given
    (SGLang 0.5.23 knows them; older releases take only `action`).
    """
    if action not in ACTIONS:
        raise ValueError(f"unknown /weights_checker action {action!r}; SGLang knows {list(ACTIONS)}")
    payload: dict[str, Any] = {"action": action}
    if skip_tensor_list is not None:
        payload["skip_tensor_list"] = list(skip_tensor_list)
    if allow_quant_error is not None:
        payload["allow_quant_error"] = bool(allow_quant_error)
    return [_request(engine, url, payload, timeout=timeout) for url in engine.urls]


def _request(engine, url: str, payload: Mapping[str, Any], *, timeout: float | None) -> dict:
    """Like `SGLangEngine._post`, with its messages, but a 400 that carries a checker result is
    returned whole (`_post` raises on it and keeps only 500 characters of the mismatch list)."""
    import httpx

    action = payload["action"]
    try:
        r = engine.client.post(f"{url}{PATH}", json=dict(payload), timeout=timeout or engine.request_timeout)
    except httpx.TransportError as exc:
        engine._raise_if_died(url, during=f"{PATH} action={action}")
        raise SGLangRequestError(f"{url}{PATH} failed: {type(exc).__name__}: {exc}") from exc
    if r.status_code == 404:
        raise WeightsCheckerMissing(
            f"{url}{PATH} (action={action}) answered 404: {MISSING_HINT}. SGLang said: {r.text[:300]}"
        )
    try:
        body = r.json()
    except ValueError:
        body = None
    body = _merge_list(body)
    if r.status_code not in (200, 400) or not (isinstance(body, dict) and "success" in body):
        raise SGLangRequestError(f"{url}{PATH} (action={action}) answered {r.status_code}: {r.text[:500]}")
    return body


def _merge_list(body: Any) -> Any:
    """A list of results (one per rank or DP worker) -> one result, as SGLang merges them:
    success = all, message = ' | '.join, the checksum ranks concatenated."""
    if not (isinstance(body, list) and body and all(isinstance(b, dict) and "success" in b for b in body)):
        return body
    merged: dict[str, Any] = {
        "success": all(bool(b["success"]) for b in body),
        "message": " | ".join(str(b.get("message", "")) for b in body),
    }
    ranks = [info for b in body for info in _rank_infos(b)]
    if ranks:
        merged["ranks"] = ranks
    return merged


def _require_success(engine, action: str, bodies: list[dict]) -> None:
    for url, body in zip(engine.urls, bodies):
        if not body.get("success"):
            raise WeightsCheckError(f"{url}{PATH} action={action} failed: {body.get('message')!r}")


# ----------------------------------------------------------------------------------------------
# Snapshot -> reset -> push -> compare
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Mismatch:
    """One tensor that differs from the snapshot, as SGLang's compare reported it (engine name)."""

    name: str
    max_abs_err: float | None = None
    mean_abs_err: float | None = None
    num_exceed: int | None = None


@dataclasses.dataclass
class ServerVerdict:
    url: str
    ok: bool
    message: str
    mismatches: list[Mismatch] = dataclasses.field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.mismatches]

    def explain(self) -> str:
        if self.ok:
            return f"{self.url}: every tensor overwritten with the expected bytes"
        if self.mismatches:
            more = len(self.mismatches) - 8
            shown = ", ".join(self.names[:8]) + (f" (+{more} more)" if more > 0 else "")
            return f"{self.url}: {len(self.mismatches)} tensor(s) differ from the snapshot: {shown}"
        if not self.message:
            return (
                f"{self.url}: compare failed with an empty message (SGLang's bare assert: no snapshot to "
                "compare with; a passing compare consumes it)"
            )
        return f"{self.url}: compare failed: {self.message[:500]}"


@dataclasses.dataclass
class OverwriteCheck:
    """Result of `verify_update_overwrites_all` / `finish_overwrite_check`: per server, whether the push
    overwrote every engine tensor with exactly the snapshot's bytes."""

    servers: list[ServerVerdict]

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.servers)

    @property
    def mismatched(self) -> list[str]:
        """Engine names that differ on any server (sorted)."""
        return sorted({n for s in self.servers for n in s.names})

    def summary(self) -> str:
        if self.ok:
            return (
                f"whole-tensor weight check ok on {len(self.servers)} server(s): the update overwrote every "
                "engine tensor with the checkpoint's bytes"
            )
        bad = [s for s in self.servers if not s.ok]
        return (
            f"whole-tensor weight check FAILED on {len(bad)} of {len(self.servers)} server(s) (the engine now "
            "holds random values where the update did not write): " + "; ".join(s.explain() for s in bad)
        )

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "mismatched": self.mismatched,
            "servers": [dataclasses.asdict(s) for s in self.servers],
            "summary": self.summary(),
        }


def parse_mismatches(message: str) -> list[Mismatch]:
    """The `name=... max_abs_err=... mean_abs_err=... num_exceed=...` lines of a failed compare, one per
    name (several ranks reporting the same name: the largest error is kept)."""
    out: dict[str, Mismatch] = {}
    for m in _MISMATCH.finditer(message or ""):
        found = Mismatch(
            m["name"], _float(m["max"]), _float(m["mean"]), int(m["exceed"]) if m["exceed"] is not None else None
        )
        prev = out.get(found.name)
        if prev is None or (found.max_abs_err or 0.0) > (prev.max_abs_err or 0.0):
            out[found.name] = found
    return list(out.values())


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def prepare_overwrite_check(engine, *, skip_tensor_list: Sequence[str] | None = None) -> None:
    """Steps 1-2 on every server: snapshot, then reset_tensors (the engine then holds random values
    until the next weight update). Raises WeightsCheckError / WeightsCheckerMissing."""
    _require_success(engine, "snapshot", check_weights(engine, "snapshot", skip_tensor_list=skip_tensor_list))
    _require_success(engine, "reset_tensors", check_weights(engine, "reset_tensors", skip_tensor_list=skip_tensor_list))


def finish_overwrite_check(
    engine, *, skip_tensor_list: Sequence[str] | None = None, allow_quant_error: bool | None = None
) -> OverwriteCheck:
    """Step 4 on every server: compare with the snapshot. A mismatch is a result, not an exception."""
    bodies = check_weights(engine, "compare", skip_tensor_list=skip_tensor_list, allow_quant_error=allow_quant_error)
    verdicts = []
    for url, body in zip(engine.urls, bodies):
        message = str(body.get("message") or "")
        ok = bool(body.get("success"))
        verdicts.append(ServerVerdict(url, ok, message, [] if ok else parse_mismatches(message)))
    return OverwriteCheck(verdicts)


def verify_update_overwrites_all(
    engine,
    push: Callable[[], None],
    *,
    skip_tensor_list: Sequence[str] | None = None,
    allow_quant_error: bool | None = None,
) -> OverwriteCheck:
    """snapshot -> reset_tensors -> `push()` -> compare, on every server of `engine`.

    `push` must send the weights the engine loaded (the trainer at its starting checkpoint), e.g.
    `lambda: engine.update_weights(trainer_weights, version)`. Returns the per-server verdict with the
    differing engine names; raises `WeightsCheckerMissing` (no endpoint), `WeightsCheckError` (snapshot
    or reset failed), and re-raises what `push` raised, noting that the engine was left randomised.
    """
    prepare_overwrite_check(engine, skip_tensor_list=skip_tensor_list)
    try:
        push()
    except BaseException as exc:
        exc.add_note(
            f"{PATH}: the engine's tensors were randomised by reset_tensors before this push failed; "
            "they hold garbage until a successful weight update or a restart"
        )
        raise
    return finish_overwrite_check(engine, skip_tensor_list=skip_tensor_list, allow_quant_error=allow_quant_error)


# ----------------------------------------------------------------------------------------------
# Checksums: every server holds the same tensors
# ----------------------------------------------------------------------------------------------


def _rank_infos(body: Mapping[str, Any]) -> list[dict]:
    """The ChecksumInfo list of a checksum body: `ranks` (0.5.23's HTTP body) or `payload` (the
    scheduler's CheckWeightsReqOutput; a list, or one dict in older code)."""
    for key in ("ranks", "payload"):
        value = body.get(key)
        if isinstance(value, dict):
            return [value]
        if isinstance(value, list):
            return [v for v in value if isinstance(v, dict)]
    return []


def _rank_key(info: Mapping[str, Any]) -> tuple:
    par = info.get("parallelism_info")
    if isinstance(par, list):
        par = next(
            (p for p in par if isinstance(p, dict) and p.get("role", "target") == "target"),
            par[0] if par and isinstance(par[0], dict) else {},
        )
    par = par if isinstance(par, dict) else {}
    return tuple(int(par.get(k, 0) or 0) for k in ("pp_rank", "dp_rank", "tp_rank", "rank"))


def checksums_of(body: Mapping[str, Any]) -> dict[str, str]:
    """One server's checksum body -> {engine name: hex}. A name held by several ranks (TP shards) gets
    sha256 over its rank hashes in (pp, dp, tp) order, so any differing shard changes it."""
    per_name: dict[str, list[str]] = collections.defaultdict(list)
    for info in sorted(_rank_infos(body), key=_rank_key):
        for name, digest in (info.get("checksums") or {}).items():
            per_name[name].append(str(digest))
    return {
        name: digests[0] if len(digests) == 1 else hashlib.sha256("|".join(digests).encode()).hexdigest()
        for name, digests in per_name.items()
    }


def engine_checksums(engine, *, skip_tensor_list: Sequence[str] | None = None) -> dict[str, dict[str, str]]:
    """{url: {engine tensor name: hex}} for every server (action=checksum)."""
    bodies = check_weights(engine, "checksum", skip_tensor_list=skip_tensor_list)
    _require_success(engine, "checksum", bodies)
    out = {}
    for url, body in zip(engine.urls, bodies):
        if not _rank_infos(body):
            raise WeightsCheckError(
                f"{url}{PATH} action=checksum answered no per-tensor checksums (neither "
                f"'ranks' nor 'payload'): keys {sorted(body)}; this SGLang predates checksum"
            )
        out[url] = checksums_of(body)
    return out


@dataclasses.dataclass
class EnginesCheck:
    """Result of `compare_engines`: which tensors differ between servers, and on which servers.

    For each name the reference is the hash most servers hold (ties: the earliest URL's); `differing`
    lists the other servers. With two servers a difference cannot tell which one is stale: the second
    is named."""

    urls: list[str]
    n_tensors: int
    differing: dict[str, list[str]]  # name -> URLs whose hash differs from the reference
    missing: dict[str, list[str]]  # name -> URLs that do not hold it

    @property
    def ok(self) -> bool:
        return not (self.differing or self.missing)

    @property
    def by_url(self) -> dict[str, list[str]]:
        """URL -> names on which it differs from the others or that it lacks."""
        out: dict[str, set[str]] = {u: set() for u in self.urls}
        for table in (self.differing, self.missing):
            for name, urls in table.items():
                for u in urls:
                    out.setdefault(u, set()).add(name)
        return {u: sorted(names) for u, names in out.items() if names}

    def summary(self) -> str:
        if self.ok:
            return f"engines agree: {len(self.urls)} server(s) hold identical {self.n_tensors} tensors"
        parts = [
            f"{u}: {', '.join(names[:8])}" + (f" (+{len(names) - 8} more)" if len(names) > 8 else "")
            for u, names in self.by_url.items()
        ]
        return (
            f"engines DISAGREE on {len(self.differing)} tensor(s), {len(self.missing)} missing, of "
            f"{self.n_tensors}: " + "; ".join(parts)
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"ok": self.ok, "by_url": self.by_url, "summary": self.summary()}


def compare_engines(checksums: Mapping[str, Mapping[str, str]]) -> EnginesCheck:
    """Check that every server holds identical tensors (input: `engine_checksums(...)`)."""
    urls = list(checksums)
    names = sorted({n for sums in checksums.values() for n in sums})
    differing: dict[str, list[str]] = {}
    missing: dict[str, list[str]] = {}
    for name in names:
        absent = [u for u in urls if name not in checksums[u]]
        if absent:
            missing[name] = absent
        held = [(u, checksums[u][name]) for u in urls if name in checksums[u]]
        counts = collections.Counter(h for _, h in held)
        if len(counts) <= 1:
            continue
        best = max(counts.values())
        reference = next(h for _, h in held if counts[h] == best)  # most common; ties: earliest URL
        differing[name] = [u for u, h in held if h != reference]
    return EnginesCheck(urls, len(names), differing, missing)
