"""One SGLang server process as a worker of its own: `infra/` runs it as a Ray actor inside the
engine's placement-group bundle, so the server gets that bundle's GPUs and dies with the actor.

The rollout worker (tasks/rollout/worker.py) talks HTTP to one or more of these (load balanced) and
watches them through `infra/remote_server.py:RemoteServer`, which has the `SGLangServer` interface.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from rollflow.tasks.model.source import resolve_model_path
from rollflow.tasks.net import node_ip
from rollflow.tasks.rollout.settings import RolloutConfig
from rollflow.tasks.rollout.sglang_config import engine_dtype
from rollflow.tasks.rollout.sglang_server import LOOPBACK, LaunchSpec, SGLangServer, free_port


def launch_spec_for(model_dir: str | Path, rollout: RolloutConfig, *, port: int | None = None,
                    base_gpu_id: int | None = None, weight_version: int | None = None) -> LaunchSpec:
    """The launch settings of one engine's server from `rollout.sglang` (plus rollflow-managed fields)."""
    cfg = rollout.sglang
    return LaunchSpec(model_path=str(model_dir), port=port or cfg.port or free_port(), tp_size=cfg.tp_size or 1,
                      host=cfg.host,
                      mem_fraction_static=cfg.mem_fraction_static, dtype=engine_dtype(rollout),
                      skip_tokenizer_init=cfg.skip_tokenizer_init, enable_memory_saver=cfg.memory_saver,
                      base_gpu_id=base_gpu_id, weight_version=weight_version, args=cfg.args,
                      launcher=tuple(cfg.launcher), python=cfg.python)


# torch's allocator settings: SGLang's memory saver (--enable-memory-saver) installs its own allocator
# hooks, which an inherited PYTORCH_CUDA_ALLOC_CONF (e.g. expandable_segments from the trainer's
# environment) breaks; SGLang strips the same two variables for its own helper processes.
ALLOCATOR_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def dropped_env(rollout: RolloutConfig) -> tuple[str, ...]:
    """Variables of the launching process the server must not inherit."""
    return ALLOCATOR_ENV if rollout.sglang.memory_saver else ()


def server_env(rollout: RolloutConfig, gpu_ids: Sequence[str] | None) -> dict[str, str]:
    """The server's extra environment. With `gpu_ids` (the physical GPUs of the engine's bundles, as
    Ray numbers them) the server sees exactly those GPUs, so its TP ranks 0..G-1 are the engine's GPUs
    and `--base-gpu-id` stays 0, even when the bundles got non-adjacent GPUs."""
    env = dict(rollout.sglang.env)
    if gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids)
    return env


class SGLangServerWorker:
    """Launches engine `index`'s server on construction (waits for /health), stops it on `stop()`."""

    def __init__(self, model_spec: str, rollout: RolloutConfig, *, index: int = 0,
                 gpu_ids: Sequence[str] | None = None, base_gpu_id: int | None = None, weight_version: int = 0,
                 log_dir: str | None = None):
        cfg = rollout.sglang
        # Several engines' server actors may share a node: each picks its own free port there.
        spec = launch_spec_for(resolve_model_path(model_spec), rollout, port=None if index else cfg.port,
                               base_gpu_id=None if gpu_ids else base_gpu_id, weight_version=weight_version)
        log_path = Path(log_dir) / f"sglang-engine{index}-{spec.port}.log" if log_dir else None
        self.index = index
        self.gpu_ids = list(gpu_ids or [])
        self.server = SGLangServer(spec, log_path=log_path, env=server_env(rollout, gpu_ids),
                                   tail_lines=cfg.log_tail_lines, drop_env=dropped_env(rollout)).start()
        try:
            self.server.wait_healthy(cfg.startup_timeout_s)
        except BaseException:
            self.server.stop(timeout=10)
            raise

    def ping(self) -> bool:
        return True

    def url(self) -> str:
        """The URL others reach the server at: loopback, or this node's IP when it binds all interfaces."""
        spec = self.server.spec
        if spec.host == LOOPBACK:
            return spec.url
        return f"http://{node_ip()}:{spec.port}"

    def info(self) -> dict:
        """Where the server runs: url, pid, its GPUs, its command line and log (for reports and tests)."""
        proc = self.server.proc
        return {"index": self.index, "url": self.url(), "pid": proc.pid if proc else None,
                "gpu_ids": self.gpu_ids, "cuda_visible_devices": self.server.env.get("CUDA_VISIBLE_DEVICES",
                                                                                      os.environ.get("CUDA_VISIBLE_DEVICES")),
                "command": list(self.server.command), "log_path": str(self.server.log_path),
                "host": self.server.spec.host, "node_ip": node_ip()}

    def poll(self) -> int | None:
        return self.server.poll()

    def alive(self) -> bool:
        return self.server.alive()

    def check_alive(self, during: str = "rollout") -> None:
        self.server.check_alive(during)

    def log_tail(self, n: int | None = None) -> list[str]:
        return self.server.log_tail(n)

    def stop(self, timeout: float = 30.0) -> int | None:
        return self.server.stop(timeout)
