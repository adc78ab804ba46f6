"""A reward server over HTTP: `rollout.reward = "http://host:port/path"`.

Each sample is one request, `POST {url}` with a JSON body

    {"prompt": <text or chat messages>, "response": str, "label": str | null, "metadata": {...},
     "group_index": int, "index": int}

and the server answers with a JSON number (the reward) or a JSON object (a dict reward: then
`rollout.reward_key` picks the field used for training, the whole dict is stored).

Requests run concurrently (`remote_reward.max_concurrency` threads), each with a timeout; connection
errors, timeouts, HTTP 429 and 5xx are retried with exponential backoff, other 4xx fail at once with
the server's message. A token, if the server wants one, comes from the environment variable named by
`remote_reward.auth_env` (sent as `Authorization: Bearer ...`), never from the config itself.
Standard library only (urllib), so it runs wherever rollflow does.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

from rollflow.artifacts.sample import Sample
from rollflow.artifacts.storage import redact_url

RETRY_STATUS = {429, 500, 502, 503, 504}


class RemoteRewardError(RuntimeError):
    pass


class RemoteReward:
    """An async per-sample reward function that scores on a reward server."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        retries: int = 2,
        backoff_s: float = 0.5,
        max_concurrency: int = 32,
        auth_env: str | None = None,
    ):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"rollout.reward={redact_url(url)!r} is not an http(s) URL")
        if "@" in parts.netloc:
            raise ValueError(
                "rollout.reward: put no credentials in the URL; set rollout.remote_reward.auth_env to "
                "the name of an environment variable holding the token"
            )
        self.url = url
        # What messages, logs and stored names show: the URL without its user:secret@ / token= parts.
        self.display_url = redact_url(url)
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_concurrency = max_concurrency
        self.auth_env = auth_env
        self.__name__ = f"remote:{self.display_url}"
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, url: str, config: Any = None) -> "RemoteReward":
        if config is None:
            return cls(url)
        return cls(
            url,
            timeout_s=config.timeout_s,
            retries=config.retries,
            backoff_s=config.backoff_s,
            max_concurrency=config.max_concurrency,
            auth_env=config.auth_env,
        )

    def __getstate__(self) -> dict[str, Any]:  # picklable (Ray, Prefect): no thread pool or lock
        state = dict(self.__dict__)
        state["_pool"], state["_lock"] = None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="rollflow-remote-reward")
            return self._pool

    @staticmethod
    def payload(sample: Sample) -> dict[str, Any]:
        return {
            "prompt": sample.prompt,
            "response": sample.response,
            "label": sample.label,
            "metadata": sample.metadata,
            "group_index": sample.group_index,
            "index": sample.index,
        }

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.auth_env:
            token = os.environ.get(self.auth_env)
            if not token:
                raise RemoteRewardError(
                    f"rollout.remote_reward.auth_env={self.auth_env!r} is not set in the "
                    "environment of the process that scores rewards"
                )
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def post(self, body: dict[str, Any]) -> Any:
        """One scored sample (blocking, with retries); returns a float or a dict."""
        data = json.dumps(body).encode()
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            request = urllib.request.Request(self.url, data=data, headers=self._headers(), method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310 - http(s) only
                    raw = response.read()
            except urllib.error.HTTPError as exc:
                text = exc.read()[:300].decode("utf-8", "replace")
                last = f"HTTP {exc.code}: {text}"
                if exc.code in RETRY_STATUS:
                    continue
                raise RemoteRewardError(f"reward server {self.display_url} answered {last} (not retried)") from None
            except (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError) as exc:
                last = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
                continue
            return self._parse(raw)
        raise RemoteRewardError(
            f"reward server {self.display_url} failed {self.retries + 1} time(s) (timeout "
            f"{self.timeout_s:g}s); last error: {last}"
        )

    def _parse(self, raw: bytes) -> Any:
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            raise RemoteRewardError(f"reward server {self.display_url} answered non-JSON: {raw[:200]!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float, dict)):
            raise RemoteRewardError(
                f"reward server {self.display_url} answered {value!r}: expected a number or an object"
            )
        return float(value) if not isinstance(value, dict) else value

    async def __call__(self, sample: Sample) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor(), self.post, self.payload(sample))
