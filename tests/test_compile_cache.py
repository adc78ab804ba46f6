"""store.compile_cache (tasks/compile_cache.py): torch.compile's caches written by one process and loaded by the
workers of a fresh one, whose first compile then hits torch's cache instead of compiling.

Real torch.compile on the CPU (inductor's C++ backend). Each process has its own empty TORCHINDUCTOR_CACHE_DIR, as a
fresh node would: a hit can only come from the store's file. The writing process, same function with nothing
loaded, is the control: it misses.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
needs_compiler = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="inductor needs a C++ compiler"
)

# The compiled function, and how its compilation is reported: torch's own counters.
PRELUDE = """
import json, sys, torch
from torch._dynamo.utils import counters

def compile_once():
    f = torch.compile(lambda x: torch.sin(x) * 2 + x.cos(), dynamic=False)
    f(torch.randn(64))
    return {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache_")}
"""

WRITER = (
    PRELUDE
    + """
from rollflow.tasks.compile_cache import save_compile_cache
from rollflow.tasks.rollout.settings import DataConfig, RolloutConfig
from rollflow.tasks.rollout.worker import RolloutWorker

uri = sys.argv[1]
worker = RolloutWorker("builtin:addition", RolloutConfig(), DataConfig(prompts_per_rollout=2), compile_cache=uri)
seen = compile_once()
worker.rollout(0)  # the first unit of work after something compiled: the engine's cache is written
worker.rollout(1)  # and only once
written = save_compile_cache(uri, "trainer")  # the same artifacts under the trainer's name
print(json.dumps({"counters": seen, "trainer_bytes": written}))
"""
)

READER = (
    PRELUDE
    + """
uri, role = sys.argv[1], sys.argv[2]
if role == "engine":
    from rollflow.tasks.rollout.settings import DataConfig, RolloutConfig
    from rollflow.tasks.rollout.worker import RolloutWorker

    RolloutWorker("builtin:addition", RolloutConfig(), DataConfig(prompts_per_rollout=2), compile_cache=uri or None)
else:
    from rollflow.tasks.train.settings import AlgoConfig, OptimConfig
    from rollflow.tasks.train.worker import TrainWorker

    TrainWorker("builtin:addition", OptimConfig(), AlgoConfig(), store_root=sys.argv[3], run="cc",
                compile_cache=uri or None)
print(json.dumps({"counters": compile_once()}))
"""
)


def _run(script: str, tmp_path: Path, *args: str) -> dict:
    inductor = tmp_path / f"inductor-{len(list(tmp_path.glob('inductor-*')))}"  # empty: a fresh node
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(inductor),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@needs_compiler
def test_a_fresh_process_loads_the_workers_cache_and_skips_compiling(tmp_path):
    from rollflow.tasks.compile_cache import cache_file, cached_roles

    uri = str(tmp_path / "compile_cache")
    wrote = _run(WRITER, tmp_path, uri)
    # the control: a fresh local cache and nothing loaded compiles for real
    assert wrote["counters"] == {"fxgraph_cache_miss": 1}
    engine_file = Path(cache_file(uri, "engine"))
    assert engine_file.stat().st_size > 1000 and wrote["trainer_bytes"] > 1000
    assert cached_roles(uri) == ["engine", "trainer"]
    assert not list(engine_file.parent.glob("*.tmp-*"))  # written through a temporary name, nothing left over

    store = str(tmp_path / "store")
    for role in ("engine", "trainer"):
        got = _run(READER, tmp_path, uri, role, store)["counters"]
        assert got.get("fxgraph_cache_hit") == 1 and not got.get("fxgraph_cache_miss"), (role, got)


def test_an_unusable_cache_is_a_miss_not_a_failure(tmp_path, caplog):
    from rollflow.tasks.compile_cache import cache_file, load_compile_cache, save_compile_cache

    uri = str(tmp_path / "cc")
    assert load_compile_cache(uri, "engine") == 0  # nothing there yet
    bad = Path(cache_file(uri, "engine"))
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not a cache")
    assert load_compile_cache(uri, "engine") == 0
    assert "compile cache" in caplog.text and "not loaded" in caplog.text
    assert load_compile_cache(None, "engine") == 0 and save_compile_cache(None, "engine") == 0


def test_run_config_resolves_the_cache_folder():
    from rollflow.flows.config import RunConfig

    cuda = {"rollout": {"device": "cuda"}, "train": {"device": "cuda"}}
    assert RunConfig(**cuda).compile_cache_uri() is None  # off unless asked for: the cache is code
    store = {"root": "s3://bucket/runs/", "compile_cache": "store"}
    assert RunConfig(store=store, **cuda).compile_cache_uri() == "s3://bucket/runs/compile_cache"
    assert RunConfig(store=store).compile_cache_uri() is None  # CPU: nothing large compiles
    assert RunConfig(store={"compile_cache": "/shared/cc"}).compile_cache_uri() == "/shared/cc"
    with pytest.raises(ValueError, match="store.compile_cache must not contain credentials"):
        RunConfig(store={"compile_cache": "s3://key:secret@bucket/cc"})
