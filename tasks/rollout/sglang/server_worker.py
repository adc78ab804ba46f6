"""One SGLang server process as a worker of its own: `infra/` runs it as a Ray actor inside the
engine's placement-group bundle, so the server gets that bundle's GPUs and dies with the actor.

The rollout worker (tasks/rollout/worker.py) talks HTTP to one or more of these (load balanced) and
watches them through `infra/remote_server.py:RemoteServer`, which has the `SGLangServer` interface.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Sequence

from rollflow.tasks.model.source import resolve_model_path
from rollflow.tasks.net import node_ip
from rollflow.tasks.rollout.results import ServerInfo
from rollflow.tasks.rollout.settings import RolloutConfig
from rollflow.tasks.rollout.sglang.from_config import dropped_env, launch_spec_for, server_env
from rollflow.tasks.rollout.sglang.server import LOOPBACK, SGLangServer


class SGLangServerWorker:
    """Launches engine `index`'s server on construction (waits for /health), stops it on `stop()`."""

    def __init__(
        self,
        model_spec: str,
        rollout: RolloutConfig,
        *,
        index: int = 0,
        gpu_ids: Sequence[str] | None = None,
        base_gpu_id: int | None = None,
        weight_version: int = 0,
        log_dir: str | None = None,
    ):
        cfg = rollout.sglang
        # Several engines' server actors may share a node: each picks its own free port there.
        spec = launch_spec_for(
            resolve_model_path(model_spec),
            rollout,
            port=None if index else cfg.port,
            base_gpu_id=None if gpu_ids else base_gpu_id,
            weight_version=weight_version,
        )
        log_path = Path(log_dir) / f"sglang-engine{index}-{spec.port}.log" if log_dir else None
        self.index = index
        self.gpu_ids = list(gpu_ids or [])
        self.server = SGLangServer(
            spec,
            log_path=log_path,
            env=server_env(rollout, gpu_ids),
            tail_lines=cfg.log_tail_lines,
            drop_env=dropped_env(rollout),
        ).start()
        try:
            self.server.wait_healthy(cfg.startup_timeout_s)
        except BaseException:
            self.server.stop(timeout=10)
            raise

    def ping(self) -> bool:
        return True

    def progress(self) -> int:
        """The work is the server process's (HTTP), not this actor's: answering while it lives is the sign of life a
        stall deadline needs (a stopped actor does not answer)."""
        return time.monotonic_ns() if self.server.alive() else 0

    def url(self) -> str:
        """The URL others reach the server at: loopback, or this node's IP when it binds all interfaces."""
        spec = self.server.spec
        if spec.host == LOOPBACK:
            return spec.url
        return f"http://{node_ip()}:{spec.port}"

    def info(self) -> ServerInfo:
        """Where the server runs: url, pid, its GPUs, its command line and log (for reports and tests)."""
        proc = self.server.proc
        return ServerInfo(
            index=self.index,
            url=self.url(),
            pid=proc.pid if proc else None,
            gpu_ids=self.gpu_ids,
            cuda_visible_devices=self.server.env.get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES")),
            command=list(self.server.command),
            log_path=str(self.server.log_path),
            host=self.server.spec.host,
            node_ip=node_ip(),
        )

    def poll(self) -> int | None:
        return self.server.poll()

    def alive(self) -> bool:
        return self.server.alive()

    def check_alive(self, during: str = "rollout") -> None:
        self.server.check_alive(during)

    def log_tail(self, n: int | None = None) -> list[str]:
        return self.server.log_tail(n)

    def memory_released(self) -> list[str]:
        return self.server.memory_released()

    def note_memory(self, released: Sequence[str] = (), resumed: Sequence[str] = ()) -> None:
        self.server.note_memory(released, resumed)

    def stop(self, timeout: float = 30.0) -> int | None:
        return self.server.stop(timeout)
