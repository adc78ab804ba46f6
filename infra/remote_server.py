"""`RemoteServer`: an SGLang server run by its own Ray actor (tasks/rollout/sglang/server_worker.py), seen
through the interface `SGLangEngine` uses for a local `SGLangServer` (url, poll, alive, check_alive,
log_tail, memory_released, note_memory, stop). Picklable: the rollout worker actor receives a list of these.

A dead server process and a dead server actor both read as "died", with the last log lines when
the actor can still give them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rollflow.tasks.rollout.sglang.server import EngineDiedError

ACTOR_GONE = -255  # poll() of a server whose actor is gone (no exit code to report)


@dataclasses.dataclass
class RemoteServer:
    actor: Any  # Ray actor handle of an SGLangServerWorker
    url: str
    name: str = ""
    timeout_s: float = 60.0

    def _get(self, ref):
        import ray

        return ray.get(ref, timeout=self.timeout_s)

    def poll(self) -> int | None:
        try:
            return self._get(self.actor.poll.remote())
        except Exception:  # noqa: BLE001 - an unreachable actor is a dead server
            return ACTOR_GONE

    def alive(self) -> bool:
        return self.poll() is None

    def check_alive(self, during: str = "rollout") -> None:
        from ray.exceptions import RayTaskError

        try:
            self._get(self.actor.check_alive.remote(during))
        except RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, EngineDiedError):
                raise cause from None  # the server's own report: exit code and log tail
            raise
        except Exception as exc:  # noqa: BLE001 - the actor itself died (node lost, killed, OOM)
            raise EngineDiedError(
                f"SGLang server actor {self.name or self.url} died during {during} ({type(exc).__name__}: {exc})",
                returncode=ACTOR_GONE,
            ) from None

    def log_tail(self, n: int | None = None) -> list[str]:
        try:
            return self._get(self.actor.log_tail.remote(n))
        except Exception:  # noqa: BLE001
            return []

    def memory_released(self) -> list[str]:
        """The tags released on this server, as its actor (alive exactly as long as the process) recorded them."""
        return list(self._get(self.actor.memory_released.remote()))

    def note_memory(self, released: list[str] | tuple[str, ...] = (), resumed: list[str] | tuple[str, ...] = ()):
        self._get(self.actor.note_memory.remote(list(released), list(resumed)))

    def stop(self, timeout: float = 30.0) -> int | None:
        try:
            return self._get(self.actor.stop.remote(timeout))
        except Exception:  # noqa: BLE001 - already gone
            return ACTOR_GONE
