"""SGLang's OWN code as the judge of what rollflow sends (CPU, no GPU, no server).

The SGLang wheel is pure Python (its CUDA kernels are separate packages), so with the `sglang-contract`
extra plus `pip install --no-deps sglang==0.5.23` (what `make setup` does) these SGLang functions run
here, unchanged:

- `prepare_server_args(argv)` (sglang/srt/server_args.py): what `python -m sglang.launch_server`
  does with its command line;
- the request structures of the HTTP routes (sglang/srt/managers/io_struct.py, validated as FastAPI
  does it: pydantic over `msgspec_struct_pydantic_core_schema`), `generate_contract_error` (the
  /generate JSON contract gate) and `GenerateReqInput.normalize_batch_and_arguments`;
- `MultiprocessingSerializer.deserialize` (its `SafeUnpickler`), `monkey_patch_torch_reductions`
  (CUDA IPC handles named by GPU UUID, mapped to the receiver's local index) and
  `FlattenedTensorBucket` (load_format="flattened_bucket");
- `SchedulerWeightUpdaterManager` (sglang/srt/managers/scheduler_components/weight_updater.py): the
  scheduler's own weight-update session and memory release / resume rules (`SchedulerRules`).

Importing those modules costs ~15 s and changes process state (environment variables, torch
reductions), so nothing here is imported by pytest itself: the fake server imports it in its own
process (`--own-code`, tests/fake_sglang_server.py) and the contract tests ask that process.

One stand-in: SGLang's multimodal config helpers import `torchvision` at module level; the PyPI
torchvision wheels are built against CUDA torch and cannot load beside a CPU torch. None of the code
used here calls it, so an empty module with the two names imported is put in its place (only when
torchvision itself is missing or broken).
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
import types
from typing import Any

SGLANG_VERSION = "0.5.23"

# HTTP route -> io_struct request class (sglang/srt/entrypoints/http_server.py, 0.5.23)
ROUTE_STRUCTS = {
    "/abort_request": "AbortReq",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/get_weights_by_name": "GetWeightsByNameReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/weights_checker": "CheckWeightsReqInput",
    "/open_session": "OpenSessionReqInput",
    "/close_session": "CloseSessionReqInput",
    "/load_lora_adapter": "LoadLoRAAdapterReqInput",
    "/load_lora_adapter_from_tensors": "LoadLoRAAdapterFromTensorsReqInput",
    "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
}


class SGLangMissing(ImportError):
    pass


def _torchvision_stand_in() -> None:
    try:
        import torchvision  # noqa: F401

        return
    except Exception:  # noqa: BLE001 - missing, or a CUDA build that cannot load here
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
    # transformers decides once whether torchvision exists; ask before the stand-in appears
    import transformers.utils.import_utils as hf_imports

    hf_imports.is_torchvision_available()
    tv = types.ModuleType("torchvision")
    tv.__path__ = []
    transforms = types.ModuleType("torchvision.transforms")
    transforms.__path__ = []
    functional = types.ModuleType("torchvision.transforms.functional")

    class InterpolationMode:  # the names the config modules read at import
        NEAREST, BILINEAR, BICUBIC = "nearest", "bilinear", "bicubic"

    transforms.InterpolationMode = functional.InterpolationMode = InterpolationMode
    tv.transforms, transforms.functional = transforms, functional
    sys.modules.update(
        {"torchvision": tv, "torchvision.transforms": transforms, "torchvision.transforms.functional": functional}
    )


class _OneRankTorch:
    """`torch` as the manager's module sees it, with the TP group of one rank: its barriers and
    gathers have nobody to wait for (no process group exists in the fake)."""

    def __init__(self, torch):
        self._torch = torch
        self.distributed = types.SimpleNamespace(
            barrier=lambda *a, **k: None,
            get_world_size=lambda *a, **k: 1,
            all_gather_object=lambda out, obj, **k: out.__setitem__(0, obj),
        )

    def __getattr__(self, name):
        return getattr(self._torch, name)


class SchedulerRules:
    """SGLang's own scheduler-side weight-update manager, for one TP rank with no model behind it.

    The fake server hands it the session and memory calls, so what the real scheduler answers (a 400
    with its message) or raises (an exception that ends the scheduler, hence the server) is decided by
    SGLang's code, not by the fake's copy of its rules. What stands in: the runners (no model: loading
    is the fake's), the memory saver (nothing to pause on CPU), the TP barrier (one rank) and the
    weight-cache mode (off, the default). `is_idle` is the fake's "no request in flight"."""

    def __init__(self, is_idle):
        import torch
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.managers.scheduler_components import weight_updater as module

        module.torch = _OneRankTorch(torch)
        module.get_parallel = lambda: types.SimpleNamespace(tp_group=types.SimpleNamespace(cpu_group=None))
        module.get_model = lambda: types.SimpleNamespace(weight_cache_mode="off")
        noop = lambda *a, **k: None  # noqa: E731
        runner = types.SimpleNamespace(
            model=torch.nn.Module(),
            weight_updater=types.SimpleNamespace(receive_weights_from_distributed=lambda **k: []),
        )
        tp_worker = types.SimpleNamespace(
            model_runner=runner, weight_update_runners=lambda: [], deserialize_own_rank=lambda payloads: []
        )
        scheduler = types.SimpleNamespace(
            _engine_paused=False, disaggregation_mode=DisaggregationMode.NULL, record_weight_version_change=noop
        )
        self.manager = module.SchedulerWeightUpdaterManager(
            tp_worker=tp_worker,
            draft_worker=None,
            memory_saver_adapter=types.SimpleNamespace(pause=noop, resume=noop),
            flush_cache=lambda **k: True,
            is_fully_idle=lambda **k: is_idle(),
            scheduler=scheduler,
        )

    def call(self, struct) -> tuple[bool, str]:
        """The manager's handler for this request (an io_struct object): (success, message). An
        exception propagates: in SGLang it ends the scheduler (scheduler.py: run_scheduler_process)."""
        name = {
            "BeginWeightUpdateReqInput": "begin_weight_update",
            "EndWeightUpdateReqInput": "end_weight_update",
            "UpdateWeightsFromTensorReqInput": "update_weights_from_tensor",
            "UpdateWeightsFromDistributedReqInput": "update_weights_from_distributed",
            "ReleaseMemoryOccupationReqInput": "release_memory_occupation",
            "ResumeMemoryOccupationReqInput": "resume_memory_occupation",
        }[type(struct).__name__]
        out = getattr(self.manager, name)(struct)
        return bool(getattr(out, "success", True)), str(getattr(out, "message", ""))

    @property
    def session_open(self) -> bool:
        return self.manager._session is not None

    @property
    def offload_tags(self) -> set[str]:
        return set(self.manager.offload_tags)


class OwnCode:
    """The SGLang objects above, imported once."""

    def __init__(self):
        import importlib.metadata
        import importlib.util

        if importlib.util.find_spec("sglang") is None:
            raise SGLangMissing(
                "sglang is not installed (make setup installs it: pip install --no-deps "
                f"sglang=={SGLANG_VERSION} plus the sglang-contract extra)"
            )
        self.version = importlib.metadata.version("sglang")
        _torchvision_stand_in()
        import msgspec
        from pydantic import TypeAdapter
        from sglang.srt.entrypoints.api_contract import generate_contract_error
        from sglang.srt.managers import io_struct
        from sglang.srt.server_args import prepare_server_args
        from sglang.srt.utils import patch_torch
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        self.msgspec = msgspec
        self.io_struct = io_struct
        self.prepare_server_args = prepare_server_args
        self.generate_contract_error = generate_contract_error
        self.serializer = MultiprocessingSerializer
        self.patch_torch = patch_torch
        self.bucket_cls = FlattenedTensorBucket
        self.adapters = {route: TypeAdapter(getattr(io_struct, name)) for route, name in ROUTE_STRUCTS.items()}

    # -- command lines ------------------------------------------------------------------------------
    def server_args(self, argv: list[str]) -> dict[str, Any]:
        """`python -m sglang.launch_server ARGV` parsed by SGLang: every field, JSON-able."""
        from sglang.srt.arg_groups.arg_utils import record_fields

        args = self.prepare_server_args(list(argv))
        out = {}
        for field in record_fields(type(args)):
            name, value = field.name, getattr(args, field.name, None)
            try:
                json.dumps(value)
                out[name] = value
            except TypeError:
                out[name] = repr(value)
        return out

    # -- scheduler rules ----------------------------------------------------------------------------
    def scheduler_rules(self, is_idle) -> SchedulerRules:
        return SchedulerRules(is_idle)

    def request(self, route: str, body: Any):
        """The io_struct object SGLang's route builds from this JSON body."""
        return self.adapters[route].validate_json(json.dumps(body if body is not None else {}))

    # -- request bodies -----------------------------------------------------------------------------
    def body_errors(self, route: str, body: Any) -> list[str]:
        """What SGLang's route does with this JSON body before any handler logic: [] = accepted.
        Keys that SGLang would silently ignore are reported too (a typo is not an accepted field)."""
        raw = json.dumps(body if body is not None else {})
        if route == "/generate":
            error = self.generate_contract_error(json.loads(raw))
            if error is not None:
                return [f"/generate contract: {error}"]
            try:
                self.generate_request(body)
            except Exception as exc:  # noqa: BLE001 - SGLang's own ValueError text
                return [f"/generate normalize: {type(exc).__name__}: {exc}"]
            return []
        adapter = self.adapters.get(route)
        if adapter is None:
            return [f"{route}: no request structure recorded for this route"]
        try:
            obj = adapter.validate_json(raw)
        except Exception as exc:  # noqa: BLE001 - pydantic's validation error, as FastAPI's 422
            return [f"{route}: {exc}"]
        known = {f.name for f in self.msgspec.structs.fields(type(obj))}
        unknown = sorted(set(body or {}) - known)
        return [f"{route}: SGLang ignores unknown field(s) {unknown}"] if unknown else []

    def generate_request(self, body: dict) -> dict[str, Any]:
        """GenerateReqInput(**body) normalized as the tokenizer manager does: the per-sample rids and
        sampling seeds SGLang ends up with."""
        obj = self.io_struct.GenerateReqInput(**body)
        obj.normalize_batch_and_arguments()
        params = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params]
        rids = obj.rid if isinstance(obj.rid, list) else [obj.rid]
        n = obj.parallel_sample_num
        # parallel sampling repeats each prompt's params n times; rids stay one per prompt
        return {
            "rids": list(rids),
            "seeds": [(p or {}).get("sampling_seed") for p in params],
            "parallel_sample_num": n,
            "batch_size": getattr(obj, "batch_size", 1),
        }

    # -- IPC payloads -------------------------------------------------------------------------------
    def payload(
        self, data: str, *, load_format: str | None = None, visible_uuids: list[str] | None = None
    ) -> dict[str, Any]:
        """Load one `serialized_named_tensors` entry as an SGLang TP rank does (tp_worker.
        deserialize_own_rank + the weight updater). CPU tensors are rebuilt for real; a CUDA IPC
        handle cannot be opened on CPU, so torch's original rebuild is replaced by a recorder after
        SGLang's patch has mapped the device slot (UUID -> local index among `visible_uuids`)."""
        import torch
        from torch.multiprocessing import reductions

        self.patch_torch.monkey_patch_torch_reductions()
        uuids = list(visible_uuids or [])
        opened: list[dict] = []

        def record(*args):
            opened.append({"device": args[6], "size": list(args[1]), "dtype": str(args[3])})
            return torch.zeros(tuple(args[1]), dtype=args[3])

        saved = (reductions._rebuild_cuda_tensor_original, torch.cuda.device_count, torch.cuda.get_device_properties)
        reductions._rebuild_cuda_tensor_original = record
        torch.cuda.device_count = lambda: len(uuids)
        torch.cuda.get_device_properties = lambda i: types.SimpleNamespace(uuid=uuids[i])
        try:
            try:
                loaded = self.serializer.deserialize(data)
            except Exception as exc:  # noqa: BLE001 - SGLang's refusal, as the scheduler would raise it
                return {"error": f"{type(exc).__name__}: {exc}", "opened": opened}
        finally:
            reductions._rebuild_cuda_tensor_original, torch.cuda.device_count, torch.cuda.get_device_properties = saved
        if load_format == "flattened_bucket":
            if not isinstance(loaded, dict) or set(loaded) != {"flattened_tensor", "metadata"}:
                return {
                    "error": f"flattened_bucket payload is {type(loaded).__name__} "
                    f"{sorted(loaded) if isinstance(loaded, dict) else ''}",
                    "opened": opened,
                }
            bucket = self.bucket_cls(flattened_tensor=loaded["flattened_tensor"], metadata=loaded["metadata"])
            named = bucket.reconstruct_tensors()
            meta_types = sorted({f"{type(m).__module__}.{type(m).__name__}" for m in loaded["metadata"]})
        else:
            named = loaded
            meta_types = []
        return {
            "tensors": [
                {"name": n, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "sha": tensor_sha(t)}
                for n, t in named
            ],
            "opened": opened,
            "metadata_types": meta_types,
        }

    def load_named(self, data: str, *, load_format: str | None = None) -> list:
        """One rank's CPU payload as (name, tensor) pairs, loaded by SGLang's deserializer (and its
        flattened-bucket reconstruction): what the fake server stores."""
        self.patch_torch.monkey_patch_torch_reductions()
        loaded = self.serializer.deserialize(data)
        if load_format == "flattened_bucket":
            bucket = self.bucket_cls(flattened_tensor=loaded["flattened_tensor"], metadata=loaded["metadata"])
            return bucket.reconstruct_tensors()
        if isinstance(loaded, dict):
            raise ValueError("a flattened bucket sent without load_format='flattened_bucket'")
        return list(loaded)


def tensor_sha(t) -> str:
    """sha256 over dtype, shape and raw bytes (the tests compute the same on their side)."""
    import torch

    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
