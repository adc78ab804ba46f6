"""The engine's side of a LoRA run's adapter sync into SGLang servers (`rollout.sglang.lora_sync=adapter`).

The servers run the base model with `--enable-lora` (rank and target modules from model.lora); every sync
loads the trainer's adapter under a new name, `rollflow-v{version}`, and generate requests name it
(`lora_path`). Per sync, on every server, in this order:

1. load the new adapter: `weight_sync=disk` -> `POST /load_lora_adapter` with a directory written as a
   saved PEFT adapter (`adapter_model.safetensors` + `adapter_config.json`), which the servers must be able
   to read; `tensor` / `distributed` -> `POST /load_lora_adapter_from_tensors` with PEFT's adapter_config
   and one serialized copy of the tensors per TP rank (SGLang's flattened bucket; CPU tensors travel by
   value: an adapter is small, and no trainer rank has to share a GPU with the server);
2. from then on generate requests name the new adapter;
3. unload the previous one (SGLang waits for the requests still using it), so a server is never
   without the current adapter;
4. `POST /update_weight_version`, so the server reports the version as after a full update.

SGLang 0.5.23's rules (sglang/srt/managers/tokenizer_control_mixin.py, lora/lora_manager.py,
lora/lora_registry.py): loading a name already loaded, unloading an unknown name, and any load without
--enable-lora answer 400 (success false, `error_message`); a generate naming an adapter never loaded is a 400
as well, and one naming an adapter since unloaded makes SGLang load it again from its path (`__tensor__` for
tensor loads: that fails, 400). So the engine names only the current adapter, and a load that fails on one
server is unloaded from the servers that took it before the error goes up.
"""

from __future__ import annotations

import base64
import json
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping

from rollflow.tasks.sync.ipc import (
    FLATTENED_BUCKET,
    deserialize_named_tensors,
    flatten_bucket,
    serialize_flattened_bucket,
)
from rollflow.tasks.sync.parity import checksums

LORA_NAME_PREFIX = "rollflow-v"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
LORA_NOT_ADAPTER_MODE = (
    "this engine takes merged weights (rollout.sglang.lora_sync=merged); adapter updates need "
    "rollout.sglang.lora_sync=adapter (servers launched with --enable-lora)"
)
MERGED_INTO_ADAPTER_ENGINE = (
    "rollout.sglang.lora_sync=adapter: the servers keep the base weights and apply the trainer's adapter, so "
    "merged weights (an engine restarted or resumed mid-run) would get the adapter twice; not supported yet: "
    "run with rollout.sglang.lora_sync=merged"
)


def write_peft_adapter(tensors: Mapping[str, Any], config: Mapping[str, Any], out_dir: str | Path) -> Path:
    """A saved PEFT adapter (what SGLang's /load_lora_adapter reads), written atomically: a temp sibling
    renamed at the end, so a server never reads half a directory."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        host = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
        save_file(host, str(tmp / ADAPTER_WEIGHTS))
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(dict(config), indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


class LoraReceiver:
    """The adapter half of `SGLangEngine` (a base class of it), beside `WeightReceiver`. It uses the engine's
    `urls`, `tp_sizes`, `weight_version`, `weight_sync`, `weight_dir`, `lora_sync`, `lora_name`,
    `lora_loads`, `lora_checksums`, `lora_listed`, `_target_version` and `_post`."""

    urls: list[str]
    tp_sizes: list[int]
    weight_version: int
    weight_sync: str
    weight_dir: Path | None
    lora_sync: str
    lora_name: str | None
    lora_loads: int
    lora_checksums: dict[str, str]
    lora_listed: dict[str, dict[str, str]]
    _post: Callable[..., Any]
    _target_version: Callable[[int], int]

    def lora_path_kind(self) -> str:
        """Which SGLang route the adapter takes: load_lora_adapter (a directory) or ..._from_tensors."""
        return "load_lora_adapter" if self.weight_sync == "disk" else "load_lora_adapter_from_tensors"

    def _next_lora_name(self, version: int) -> str:
        name = f"{LORA_NAME_PREFIX}{version}"
        # a re-sync of the current version (the startup check) loads beside the current adapter, not over it:
        # SGLang refuses a name that is loaded
        return name if name != self.lora_name else f"{name}-r{self.lora_loads}"

    def update_lora_adapter(self, tensors: Mapping[str, Any], config: Mapping[str, Any], weight_version: int) -> str:
        """Load the trainer's adapter (PEFT names, PEFT adapter_config) on every server under a new name, name
        it in every later generate request, unload the previous one, set the version. Returns the name."""
        if self.lora_sync != "adapter":
            raise RuntimeError(LORA_NOT_ADAPTER_MODE)
        version = self._target_version(weight_version)
        name = self._next_lora_name(version)
        items = sorted(tensors.items())
        if self.weight_sync == "disk":
            if self.weight_dir is None:
                self.weight_dir = Path(tempfile.mkdtemp(prefix="rollflow-sglang-weights-"))
            target = self.weight_dir / f"lora-v{version:06d}-{self.lora_loads}"
            directory = write_peft_adapter(dict(items), config, target)
            from safetensors.torch import load_file

            # what the servers will read, read back
            sent = checksums(load_file(str(directory / ADAPTER_WEIGHTS)))
            bodies = {url: {"lora_name": name, "lora_path": str(directory)} for url in self.urls}
            route = "/load_lora_adapter"
        else:
            flat, entries = flatten_bucket(items)
            # One serialization per TP rank, as for the tensor path: each rank deserializes only its own copy
            # (tp_worker.deserialize_own_rank).
            raws = [serialize_flattened_bucket(flat, entries) for _ in range(sum(self.tp_sizes))]
            sent = checksums(dict(deserialize_named_tensors(raws[0])))  # what the first rank will read
            payloads = [base64.b64encode(raw).decode("ascii") for raw in raws]
            bodies, offset = {}, 0
            for url, tp in zip(self.urls, self.tp_sizes):
                bodies[url] = {
                    "lora_name": name,
                    "config_dict": dict(config),
                    "serialized_named_tensors": payloads[offset : offset + tp],
                    "load_format": FLATTENED_BUCKET,
                }
                offset += tp
            route = "/load_lora_adapter_from_tensors"
        loaded: list[str] = []
        try:
            for url in self.urls:
                answer = self._post(url, route, bodies[url])
                loaded.append(url)
                self.lora_listed[url] = dict((answer or {}).get("loaded_adapters") or {})
        except BaseException:
            for url in loaded:  # the servers keep serving the previous adapter; the new one goes again
                try:
                    self._post(url, "/unload_lora_adapter", {"lora_name": name}, timeout=60.0)
                except Exception:  # noqa: BLE001 - best effort while the load's error is on its way up
                    pass
            raise
        previous, self.lora_name = self.lora_name, name
        self.lora_loads += 1
        self.lora_checksums = sent
        if previous is not None:
            for url in self.urls:
                answer = self._post(url, "/unload_lora_adapter", {"lora_name": previous})
                self.lora_listed[url] = dict((answer or {}).get("loaded_adapters") or {})
        for url in self.urls:
            self._post(url, "/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
        self.weight_version = version
        if self.weight_sync == "disk":
            self._drop_old_adapter_dirs(keep=directory)
        return name

    def _drop_old_adapter_dirs(self, keep: Path) -> None:
        # the previous directory stays: SGLang reloads an evicted adapter from its path
        dirs = sorted(self.weight_dir.glob("lora-v*"), key=lambda p: p.stat().st_mtime)
        for old in dirs[:-2]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)

    def lora_report(self) -> dict[str, Any]:
        """What parity checks in adapter mode: the adapter's name, the fingerprints of its tensors as the
        servers read them (decoded from the payload / read back from the directory), and per server the
        adapters its last answer listed (exactly the current one after a sync)."""
        return {"name": self.lora_name, "checksums": dict(self.lora_checksums), "listed": dict(self.lora_listed)}
