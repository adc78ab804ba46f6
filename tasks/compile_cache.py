"""torch.compile's caches kept in the run's store, so that a fresh node's first iteration skips compilation.

On CUDA the first iteration pays for compiling the hf engine's static-cache decode step and the trainer's fused
kernels (~25-35 s at 1.5B: the first iteration took 2.25x a steady one on a fresh machine, 1.49x once torch's local
cache was warm; docs/performance.md section 7). torch keeps those results in a local folder
(`TORCHINDUCTOR_CACHE_DIR`), which a new pod or node does not have. torch's portable cache artifacts
(`torch.compiler.save_cache_artifacts` / `load_cache_artifacts`: inductor graphs, AOTAutograd entries, Triton
kernels) carry them: each worker loads the store's copy before anything compiles and writes its own after its first
compiled work, under a key of the torch / CUDA build and the GPU model, so only a matching setup reads them.

A cache never fails a run: a missing, unreadable or mismatched file is a miss (logged), and torch checks every
entry against the graph it compiles, so a stale entry is not used.

A cache is code, not data: it holds compiled kernels the workers run, and torch unpickles it. It is therefore off
unless asked for (store.compile_cache), the one read path of rollflow that unpickles (docs/architecture.md,
"No pickle in a read path"): keep it where only whoever may change the run's code can write.
"""

from __future__ import annotations

import logging
import re
import uuid

import torch

from rollflow.artifacts.storage import open_fs

log = logging.getLogger(__name__)


def cache_key() -> str:
    """What a cache entry depends on besides the graph: the torch build, its CUDA, the GPU model."""
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    key = f"torch-{torch.__version__}-cuda-{torch.version.cuda or 'none'}-{device}"
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", key)


def cache_file(uri: str, role: str) -> str:
    return f"{uri.rstrip('/')}/{cache_key()}/{role}.bin"


def cached_roles(uri: str | None) -> list[str]:
    """The roles with a cache under `uri` for this setup's key (what a worker started now would load)."""
    if not uri:
        return []
    fs, folder = open_fs(f"{uri.rstrip('/')}/{cache_key()}")
    if not fs.exists(folder):
        return []
    return sorted(p.rsplit("/", 1)[-1].removesuffix(".bin") for p in fs.ls(folder, detail=False) if p.endswith(".bin"))


def load_compile_cache(uri: str | None, role: str) -> int:
    """Load `role`'s cache artifacts from `uri` into this process's torch caches (call before anything compiles);
    the bytes loaded, 0 when there is no usable file."""
    if not uri:
        return 0
    path = cache_file(uri, role)
    try:
        fs, local = open_fs(path)
        if not fs.exists(local):
            return 0
        blob = fs.cat_file(local)
        loaded = torch.compiler.load_cache_artifacts(blob)  # None when torch cannot read the file (it logs why)
    except Exception as exc:  # noqa: BLE001 - a cache is an optimisation: compile as if it were not there
        log.warning("compile cache %s not loaded (%s: %s); compiling from scratch", path, type(exc).__name__, exc)
        return 0
    if loaded is None:
        log.warning("compile cache %s not loaded (torch could not read it); compiling from scratch", path)
        return 0
    return len(blob)


def save_compile_cache(uri: str | None, role: str) -> int:
    """Write what this process compiled so far as `role`'s cache artifacts; the bytes written (0: nothing compiled,
    the same size is there already, or the write failed, which is logged)."""
    saved = torch.compiler.save_cache_artifacts() if uri else None
    return write_compile_cache(uri, role, saved[0]) if saved and saved[0] else 0


def write_compile_cache(uri: str | None, role: str, blob: bytes) -> int:
    if not uri:
        return 0
    path = cache_file(uri, role)
    try:
        fs, local = open_fs(path)
        if fs.exists(local) and fs.size(local) == len(blob):
            return 0
        if "file" in _protocols(fs):
            # A reader must never see half a file: a local write goes to a temporary name first.
            fs.makedirs(local.rsplit("/", 1)[0], exist_ok=True)
            tmp = f"{local}.tmp-{uuid.uuid4().hex}"
            fs.pipe_file(tmp, blob)
            fs.mv(tmp, local)
        else:
            fs.pipe_file(local, blob)  # one PUT: whole or absent
    except Exception as exc:  # noqa: BLE001 - the run goes on; the next one compiles again
        log.warning("compile cache %s not written (%s: %s)", path, type(exc).__name__, exc)
        return 0
    return len(blob)


def _protocols(fs) -> set[str]:
    return {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)


class CompileCacheSaver:
    """Saves `role`'s cache once, after the first unit of work that compiled something (a worker asks after each
    one; until torch has artifacts nothing is written, and after the first write nothing more)."""

    def __init__(self, uri: str | None, role: str):
        self.uri, self.role = uri, role
        self.done = not uri

    def after_work(self) -> int:
        if self.done:
            return 0
        saved = torch.compiler.save_cache_artifacts()
        if not saved or not saved[0]:
            return 0  # nothing compiled yet (e.g. a CPU engine): ask again next time
        self.done = True
        return write_compile_cache(self.uri, self.role, saved[0])
