"""Reward functions of issue 10: built-ins, per-group and async functions, and a reward server over
loopback HTTP (a real `http.server` in a thread)."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rollflow.artifacts.sample import Sample
from rollflow.tasks.rollout.remote_reward import RemoteReward, RemoteRewardError
from rollflow.tasks.rollout.rewards import (
    exact_match_reward,
    extract_answer,
    extract_boxed,
    extract_last_number,
    f1_score,
    group_reward,
    math_reward,
    resolve_reward_fn,
    reward_fn_from_config,
    score_samples,
)
from rollflow.tasks.rollout.settings import RolloutConfig


def sample(response: str, label: str | None = None, group: int = 0, index: int = 0, **meta) -> Sample:
    return Sample(
        group_index=group,
        index=index,
        prompt=[{"role": "user", "content": "q"}],
        tokens=[1, 2],
        response=response,
        response_length=1,
        loss_mask=[1],
        rollout_log_probs=[-0.1],
        label=label,
        metadata=dict(meta),
    )


def test_exact_match():
    assert exact_match_reward(sample(" 42\n", "42")) == 1.0
    assert exact_match_reward(sample("42.", "42")) == 0.0
    assert resolve_reward_fn("exact_match") is exact_match_reward


@pytest.mark.parametrize(
    "response,label,want",
    [
        ("so the answer is \\boxed{42}.", "42", 1.0),
        ("first 3 then 5, final: 17", "17", 1.0),
        ("she has 1,234 apples", "1234", 1.0),
        ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
        ("The answer is 12. Then 7", "12", 0.0),  # the last number counts when nothing is boxed
        ("\\boxed{12} ... later 7", "12", 1.0),  # a boxed answer beats a later number
        ("Natalia sold 72 clips", "She sold 48 + 24 = 72.\n#### 72", 1.0),  # GSM8K label
        ("3 + 15 = 18.\n#### 18\nOr 20 with the box", "18", 1.0),  # a '####' answer beats later numbers
        ("answer: -3.50", "-3.5", 1.0),
        ("no number here", "5", 0.0),
        ("\\boxed{x+1}", "\\boxed{x + 1}", 1.0),  # non-numeric answers: normalised text
    ],
)
def test_math_answer_extraction(response, label, want):
    assert math_reward(sample(response, label)) == want


def test_extractors():
    assert extract_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert extract_boxed("\\boxed{1} and \\boxed{2}") == "2"
    assert extract_boxed("\\boxed{unfinished") is None
    assert extract_last_number("x 3 y 4.5 z") == "4.5" and extract_last_number("none") is None
    assert extract_answer("7 then \\boxed{8}") == "8"


def test_f1():
    assert f1_score("The cat sat", "cat sat") == 1.0  # articles and case are normalised away
    assert f1_score("a red car", "the blue car") == pytest.approx(0.5)
    assert f1_score("", "") == 1.0 and f1_score("x", "") == 0.0
    assert resolve_reward_fn("f1")(sample("Paris, France", "paris")) == pytest.approx(2 / 3)


@pytest.fixture
def reward_module():
    mod = types.ModuleType("rf_issue10")

    @group_reward
    def rank_in_group(samples):  # a group function: rewards relative to the group's other samples
        lengths = [len(s.response) for s in samples]
        return [1.0 if n == min(lengths) else 0.0 for n in lengths]

    async def async_group(samples):
        await asyncio.sleep(0.01)
        return [float(i) for i, _ in enumerate(samples)]

    async_group.reward_scope = "group"

    def plain_group(samples):  # made a group function by rollout.reward_scope=group
        return [len(samples)] * len(samples)

    def bad_group(samples):
        return [1.0]

    bad_group.reward_scope = "group"

    calls = []

    async def slow_async(s):
        calls.append(time.perf_counter())
        await asyncio.sleep(0.05)
        return {"acc": 1.0, "len": float(len(s.response))}

    for fn in (rank_in_group, async_group, plain_group, bad_group, slow_async):
        setattr(mod, fn.__name__, fn)
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


def _two_groups():
    return [
        sample(r, "x", group=g, index=i)
        for i, (g, r) in enumerate([(0, "aa"), (0, "a"), (0, "aaa"), (1, "bbb"), (1, "bb"), (1, "b")])
    ]


def test_group_rewards_sync_async_and_scope(reward_module):
    out = score_samples(_two_groups(), resolve_reward_fn("rf_issue10:rank_in_group"))
    assert [s.reward for s in out] == [0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    out = score_samples(_two_groups(), resolve_reward_fn("rf_issue10.async_group"))
    assert [s.reward for s in out] == [0.0, 1.0, 2.0, 0.0, 1.0, 2.0]
    cfg = RolloutConfig(reward="rf_issue10:plain_group", reward_scope="group")
    assert [s.reward for s in score_samples(_two_groups(), reward_fn_from_config(cfg))] == [3.0] * 6
    with pytest.raises(ValueError, match="returned 1 rewards for group 0 of 3 samples"):
        score_samples(_two_groups(), resolve_reward_fn("rf_issue10:bad_group"))


def test_async_sample_rewards_run_concurrently_with_dict_key(reward_module):
    samples = [sample("r" * i, "x", index=i) for i in range(8)]
    started = time.perf_counter()
    out = score_samples(samples, resolve_reward_fn("rf_issue10:slow_async"), reward_key="len")
    assert time.perf_counter() - started < 0.3  # 8 x 50 ms sequentially would be 0.4 s
    assert [s.scalar_reward() for s in out] == [float(i) for i in range(8)]
    assert out[3].reward == {"acc": 1.0, "len": 3.0} and out[3].reward_key == "len"


def test_async_rewards_inside_a_running_event_loop(reward_module):
    async def main():  # e.g. a reward scored from async code: no "asyncio.run() cannot be called" error
        return score_samples(_two_groups(), resolve_reward_fn("rf_issue10:async_group"))

    assert [s.reward for s in asyncio.run(main())][:3] == [0.0, 1.0, 2.0]


# ---- the reward server over loopback HTTP ------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep the test output clean
        pass

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        server.seen.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
        mode = self.path.strip("/")
        if mode == "flaky" and len(server.seen) <= 2:
            return self._send(503, {"error": "warming up"})
        if mode == "bad":
            return self._send(400, {"error": "label missing"})
        if mode == "slow":
            time.sleep(0.5)
        if mode == "dict":
            return self._send(200, {"correct": float(body["response"] == body["label"]), "n": len(body["response"])})
        return self._send(200, 1.0 if body["response"].strip() == body["label"] else 0.0)

    def _send(self, code, payload):
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        # the timeout test's client hangs up before the slow answer is written: expected, not worth a traceback
        import sys

        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


@pytest.fixture
def reward_server():
    server = _Server(("127.0.0.1", 0), _Handler)
    server.seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_remote_reward_float_dict_and_payload(reward_server, monkeypatch):
    server, base = reward_server
    samples = [sample("42", "42", index=0, source="gsm8k"), sample("41", "42", index=1)]
    cfg = RolloutConfig(reward=f"{base}/score", remote_reward={"auth_env": "RF_TEST_REWARD_TOKEN"})
    monkeypatch.setenv("RF_TEST_REWARD_TOKEN", "tok-123")
    out = score_samples(samples, reward_fn_from_config(cfg))
    assert [s.reward for s in out] == [1.0, 0.0]
    first = next(x for x in server.seen if x["body"]["index"] == 0)
    assert first["body"] == {
        "prompt": [{"role": "user", "content": "q"}],
        "response": "42",
        "label": "42",
        "metadata": {"source": "gsm8k"},
        "group_index": 0,
        "index": 0,
    }
    assert first["auth"] == "Bearer tok-123"
    out = score_samples([sample("42", "42")], resolve_reward_fn(f"{base}/dict"), reward_key="correct")
    assert out[0].reward == {"correct": 1.0, "n": 2} and out[0].scalar_reward() == 1.0


def test_remote_reward_retries_then_fails_clearly(reward_server):
    server, base = reward_server
    flaky = RemoteReward(f"{base}/flaky", retries=2, backoff_s=0.01)
    assert score_samples([sample("1", "1")], flaky)[0].reward == 1.0
    assert len(server.seen) == 3  # 503, 503, then 200
    server.seen.clear()
    with pytest.raises(RemoteRewardError, match="HTTP 400.*label missing.*not retried"):
        score_samples([sample("1", "1")], RemoteReward(f"{base}/bad", retries=3, backoff_s=0.01))
    assert len(server.seen) == 1
    with pytest.raises(RemoteRewardError, match=r"failed 2 time\(s\) \(timeout 0.1s\)"):
        score_samples([sample("1", "1")], RemoteReward(f"{base}/slow", timeout_s=0.1, retries=1, backoff_s=0.01))
    with pytest.raises(RemoteRewardError, match="failed 1 time"):  # nothing listens there
        RemoteReward("http://127.0.0.1:9/none", retries=0, timeout_s=0.5).post({})
    with pytest.raises(ValueError, match="no credentials in the URL"):
        resolve_reward_fn("http://user:pw@127.0.0.1:1/x")
